"""The recipes of docs/datasets.md run as written — read from the page, so they cannot drift — on
synthetic files in the real formats (CIFAR's python pickles, an arrays .npz with writer ids,
ImageNet-LT's split files over JPEG folders), shortened to one round with a few clients; a
damaged file of any kind is one line and exit 2."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import numpy as np
import pytest

import fake_dataset_files
import fedlt.datasets
from fedlt.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")

PAGE = Path(__file__).resolve().parents[1] / "docs" / "datasets.md"
SHORT = ["--rounds", "1", "--eval-every", "1", "--test-limit", "100", "--quiet", "--threads", "1"]
WRITERS = 3597  # the recipe's client count: one per writer, as in LEAF's FEMNIST


def recipes() -> dict[str, list[str]]:
    """The ``fedlt run`` commands of the page's Recipes section, by dataset, as argv lists."""
    section = PAGE.read_text().split("## Recipes", 1)[1]
    commands = [block.replace("\\\n", " ") for block in re.findall(r"^```bash\n(.*?)^```", section, re.S | re.M)]
    argvs = [shlex.split(c)[1:] for c in commands if c.startswith("fedlt run")]
    return {argv[argv.index("--dataset") + 1].split("(")[0]: argv for argv in argvs}


def value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def femnist_like(path: Path, writers: int = WRITERS, per_writer: int = 3) -> Path:
    rng = np.random.default_rng(0)
    n = writers * per_writer
    np.savez(path, x_train=rng.random((n, 28, 28), dtype=np.float32), y_train=rng.integers(0, 62, n),
             x_test=rng.random((200, 28, 28), dtype=np.float32), y_test=rng.integers(0, 62, 200),
             groups_train=np.array([f"f{w:04d}_{w % 97:02d}" for w in range(writers) for _ in range(per_writer)]))
    return path


def imagenet_lt_like(root: Path, argv: list[str]) -> None:
    """ImageNet-LT's split files (the names the recipe gives) over JPEG folders: 40 of the 1000
    classes hold 40 down to 5 training images (the long tail), the test list is balanced over
    them and names class 999 once (the class count is the largest label + 1)."""
    from PIL import Image

    spec = fedlt.datasets.parse(value(argv, "--dataset"))[1]
    rng = np.random.default_rng(0)
    rows = {"train": [], "test": []}
    for c in range(40):
        wnid = f"n{1440764 + c:08d}"
        for split, n in (("train", int(40 * (5 / 40) ** (c / 39))), ("test", 2)):
            for i in range(n):
                rel = f"{'train' if split == 'train' else 'val'}/{wnid}/{wnid}_{split}{i}.JPEG"
                (root / rel).parent.mkdir(parents=True, exist_ok=True)
                h, w = (int(v) for v in rng.integers(20, 48, 2))
                Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(root / rel, format="JPEG")
                rows[split].append(f"{rel} {c}")
    rows["test"].append(f"{rows['test'][0].split()[0]} 999")
    (root / spec["train_list"]).write_text("\n".join(rows["train"]) + "\n")
    (root / spec["test_list"]).write_text("\n".join(rows["test"]) + "\n")


def test_the_page_has_the_four_recipes():
    assert set(recipes()) == {"cifar10", "cifar100", "arrays", "imagefolder"}


@pytest.mark.parametrize("dataset,train_size", [("cifar10", 5000), ("cifar100", 12000), ("arrays", None),
                                                ("imagefolder", None)])
def test_a_recipe_runs_as_written(dataset, train_size, tmp_path, monkeypatch):
    """CIFAR: enough synthetic images that the tail of IF = 100 keeps a sample of every class
    (n_max ≥ 100), the paper's model, partition, augmentation and grouping, 4 participants.
    FEMNIST-like: one client per writer, as many writers as the recipe's clients."""
    argv = recipes()[dataset]
    out = tmp_path / "run"
    if dataset == "arrays":
        root = femnist_like(tmp_path / value(argv, "--data-root"))
        short = ["--participation", str(4 / WRITERS)]
    elif dataset == "imagefolder":  # ResNet-50 at 224² on a CPU: one local step of B_k = 2 images, 20 test images
        monkeypatch.chdir(tmp_path)  # the recipe's cache folder is relative to where it runs
        root = tmp_path / value(argv, "--data-root")
        imagenet_lt_like(root, argv)
        short = ["--participation", str(4 / int(value(argv, "--clients"))), "--local-epochs", "none",
                 "--local-iters", "1", "--server-batch", "8"]
    else:
        monkeypatch.setattr(fake_dataset_files, "N_TRAIN", train_size)
        root = tmp_path / value(argv, "--data-root")
        root.mkdir()
        fake_dataset_files.write(dataset, root, monkeypatch)
        # one local step of 16 images a participant: what is checked (model, partition, augmentation,
        # grouping as the page writes them) is all there at the first step; an epoch of ResNet-34 steps
        # at batch 64 was ~8 s more of the same code
        short = ["--participation", str(4 / int(value(argv, "--clients"))), "--local-epochs", "none",
                 "--local-iters", "1", "--batch-size", "16"]
    argv = [a if a != value(argv, "--data-root") else str(root) for a in argv]
    main([*argv, *short, *SHORT, *(["--test-limit", "20"] if dataset == "imagefolder" else []),
          "--out", str(out)])  # a flag given twice: the last one counts
    manifest = json.loads((out / "partition.json").read_text())
    summary = json.loads((out / "summary.json").read_text())
    config = json.loads((out / "config.json").read_text())
    assert manifest["num_clients"] == int(value(argv, "--clients")) and summary["rounds"] == 1
    assert 0 <= summary["final"]["accuracy"] <= 1
    if dataset == "arrays":  # one writer per client, whole
        assert manifest["name"] == "natural" and manifest["summary"]["samples_per_client"]["max"] == 3
    elif dataset == "imagefolder":  # 1000 classes from the labels; the images a step read are in the cache
        assert len(summary["final"]["per_class_accuracy"]) == 1000 and manifest["name"] == "dirichlet"
        filled = [np.fromfile(f, dtype=np.uint8) for f in (tmp_path / "data" / "ImageNet_LT" / "cache").glob("*.filled")]
        steps, tested = sorted(int(f.sum()) for f in filled)
        assert tested == 20 and 4 <= steps <= 8  # each participant's one step of B_k ≥ 1 (Σ B_k ≤ 8) images
    else:
        assert manifest["params"]["then"]["name"] == "dirichlet" and config["groups"]["rule"] == "share"
        totals = manifest["summary"]["global_class_counts"]
        assert max(totals) / min(totals) > 50  # the long tail: IF 100 of the head class, up to flooring
        assert config["augment"] == [{"name": "random_crop", "padding": 4}, {"name": "hflip"}]


def test_damaged_files_are_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    fake_dataset_files.write("cifar10", tmp_path, monkeypatch)
    (tmp_path / "cifar-10-batches-py" / "data_batch_3").write_bytes(b"garbage, not a pickle")
    bad = femnist_like(tmp_path / "femnist.npz", writers=5)
    with np.load(bad) as arrays:
        np.savez(bad, **{**arrays, "groups_train": arrays["groups_train"][:-1]})
    for argv, message in ((["--dataset", "cifar10", "--data-root", str(tmp_path)], "a file is damaged"),
                          (["--dataset", "arrays", "--data-root", str(bad)], "groups_train has shape (14,)")):
        with pytest.raises(SystemExit) as info:
            main(["run", *argv, "--out", str(tmp_path / "run"), "--quiet"])
        err = capsys.readouterr().err.strip()
        assert info.value.code == 2 and message in err and len(err.splitlines()) == 1, err
