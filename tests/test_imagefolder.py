"""The ``imagefolder`` dataset and the lazy image source behind the engine: images decode exactly as
torchvision's ImageFolder with Resize + CenterCrop does (an independent reference), both layouts
pass the dataset contract, a run streaming the files equals — bit for bit — the same run on the
decoded tensors held in memory, with 0 or 2 loader workers and in worker processes, the cache
returns what was decoded, and every bad file is one line and exit 2."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import fedlt.datasets
from fedlt.cli import main
from fedlt.datasets import imagefolder as imagefolder_module
from fedlt.datasets.base import InMemoryDataset
from fedlt.datasets.imagefolder import FileImages
from fedlt.datasets.source import images
from fedlt.errors import FedltError
from fedlt.testing import check_dataset

from conftest import without_timings
from test_hostile_inputs import fails_cleanly

pytestmark = pytest.mark.usefixtures("one_thread")


def write_tree(root: Path, n_train: int = 48, n_test: int = 18, classes: int = 3, seed: int = 0,
               sizes: tuple[int, int] = (10, 40)) -> dict[str, list[tuple[str, int]]]:
    """root/{train,test}/c<k>/<i>.{png,jpg} of random sizes (some below, some above the target),
    every class in both splits; the (relative path, label) of each file, by split."""
    rng = np.random.default_rng(seed)
    written: dict[str, list[tuple[str, int]]] = {}
    for split, n in (("train", n_train), ("test", n_test)):
        written[split] = []
        for i in range(n):
            label = i % classes
            rel = f"{split}/c{label}/{i:03d}.{'png' if i % 2 else 'jpg'}"
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            h, w = (int(v) for v in rng.integers(*sizes, 2))
            base = rng.integers(0, 256, 3)  # a tint per image: channel statistics that are not all alike
            pixels = np.clip(base + rng.normal(0, 40, (h, w, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(root / rel)
            written[split].append((rel, label))
    return written


def write_lists(root: Path, written: dict[str, list[tuple[str, int]]], seed: int = 1) -> tuple[str, str]:
    """ImageNet-LT style split files listing the same images in a shuffled order (and a blank line)."""
    rng = np.random.default_rng(seed)
    names = []
    for split in ("train", "test"):
        rows = [f"{rel} {label}" for rel, label in written[split]]
        rows = [rows[i] for i in rng.permutation(len(rows))]
        (root / f"{split}_list.txt").write_text("\n".join(rows[:3] + [""] + rows[3:]) + "\n")
        names.append(f"{split}_list.txt")
    return names[0], names[1]


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("imagefolder")
    return root, write_tree(root)


def reference(root: Path, size: int, fit: str = "crop", channels: int = 3) -> tuple[torch.Tensor, list[int], list[str]]:
    """torchvision's ImageFolder over root/train with the usual Resize + CenterCrop, as uint8."""
    from torchvision import datasets, transforms

    resize = [transforms.Resize(size), transforms.CenterCrop(size)] if fit == "crop" else [transforms.Resize((size, size))]
    mode = "RGB" if channels == 3 else "L"
    ref = datasets.ImageFolder(str(root / "train"), transform=transforms.Compose([*resize, transforms.PILToTensor()]),
                               loader=lambda p: Image.open(p).convert(mode))
    pixels = torch.stack([ref[i][0] for i in range(len(ref))])
    return pixels, [ref[i][1] for i in range(len(ref))], ref.classes


@pytest.mark.parametrize("size,fit,channels", [(16, "crop", 3), (24, "crop", 1), (12, "stretch", 3)])
def test_images_decode_as_torchvision_imagefolder_and_are_standardised(tree, size, fit, channels):
    root, _ = tree
    want, labels, classes = reference(root, size, fit, channels)
    data = fedlt.datasets.load(f"imagefolder(image_size={size}, fit={fit}, channels={channels})", root=root)
    assert data.class_names == tuple(classes) and data.y_train.tolist() == labels
    assert torch.equal(torch.from_numpy(data.x_train.files.read(np.arange(len(labels)))).permute(0, 3, 1, 2), want)
    # standardised by the training pixels' mean and population std (all of them: fewer than 2048 images)
    unit = want.double() / 255
    mean, std = unit.mean(dim=(0, 2, 3)), unit.std(dim=(0, 2, 3), unbiased=False)
    expected = (unit - mean.view(1, -1, 1, 1)) / std.view(1, -1, 1, 1)
    got = data.x_train.take(slice(None))
    assert got.dtype == torch.float32 and got.is_contiguous(memory_format=torch.channels_last)
    assert torch.allclose(got.double(), expected, atol=1e-5)
    assert tuple(data.x_train.shape) == (len(labels), channels, size, size) == tuple(got.shape)


def test_split_lists_read_the_same_images_as_the_folders(tree):
    root, written = tree
    train_list, test_list = write_lists(root, written)
    folders = fedlt.datasets.load("imagefolder(image_size=20)", root=root)
    lists = fedlt.datasets.load(f"imagefolder(image_size=20, train_list='{train_list}', test_list='{test_list}')",
                                root=root)
    assert lists.num_classes == folders.num_classes == 3 and lists.class_names is None
    for split in ("train", "test"):
        a, b = getattr(folders, f"x_{split}"), getattr(lists, f"x_{split}")
        at = {os.fsdecode(p): i for i, p in enumerate(a.files.listing.paths)}
        order = torch.tensor([at[os.fsdecode(p)] for p in b.files.listing.paths])
        assert torch.equal(getattr(lists, f"y_{split}"), getattr(folders, f"y_{split}")[order])
        if split == "train":  # the same training images: the same statistics, the same tensors
            assert torch.equal(b.take(slice(None)), a.take(order))


def test_both_layouts_pass_the_dataset_contract(tree):
    root, written = tree
    train_list, test_list = write_lists(root, written)
    check_dataset("imagefolder", {"root": root, "image_size": 16})
    check_dataset("imagefolder", {"root": root, "image_size": 8, "channels": 1, "train_list": train_list,
                                  "test_list": test_list})


def test_only_paths_and_labels_are_held(tree):
    """What a split holds (and what crosses to a worker process) grows with the paths, not the pixels."""
    root, written = tree
    data = fedlt.datasets.load("imagefolder(image_size=64)", root=root)
    n = len(written["train"])
    pixel_bytes = n * 3 * 64 * 64 * 4
    assert len(pickle.dumps(data.x_train)) < n * 200 < pixel_bytes / 10
    assert images(data.x_train).shared() is data.x_train


def test_loader_processes_start_once_per_split_and_serve_every_stream_in_its_order(tree):
    """Streams one after another reuse the same worker processes; two open at once get one loader
    each; every stream returns its own batches, in its order, as decoded in this process."""
    root, _ = tree
    data = fedlt.datasets.load("imagefolder(image_size=12)", root=root)
    source, labels = data.x_train.loading(2), data.y_train

    def read(x, client_labels, order):
        return [(b.clone(), y) for b, y in x.batches(client_labels, order)]

    def kept():
        return [loader for loaders in source.files.kept.values() for loader, _ in loaders]

    orders = [[torch.tensor([3, 1]), torch.tensor([0, 2, 4])], [torch.tensor([9, 8, 7])]]
    for client, order in zip((torch.arange(0, 20), torch.arange(20, 40)), orders):
        streamed = read(source.subset(client), labels[client], order)
        here = read(data.x_train.subset(client), labels[client], order)
        assert all(torch.equal(a, b) and torch.equal(ya, yb) for (a, ya), (b, yb) in zip(streamed, here))
        assert len(streamed) == len(order)
        (loader,) = kept()
        pids = [w.pid for w in loader._iterator._workers]
        assert len(pids) == 2 and (client[0] == 0 or pids == first_pids)
        first_pids = pids
    one, two = source.batches(labels, orders[0]), source.batches(labels, orders[1])  # open together
    a, b = next(one), next(two)
    assert torch.equal(a[0], data.x_train.take(orders[0][0])) and torch.equal(b[0], data.x_train.take(orders[1][0]))
    assert torch.equal(next(one)[0], data.x_train.take(orders[0][1]))
    one.close(), two.close()
    assert len(kept()) == 2


# -- runs -----------------------------------------------------------------------------------------
RUN = ["--clients", "4", "--participation", "0.5", "--rounds", "2", "--eval-every", "1", "--partition", "iid",
       "--local-iters", "3", "--server-batch", "16", "--set", "eval_batch=7", "--quiet",
       "--augment", "random_crop(padding=2) + hflip + resize(size=28) + normalize"]  # normalize: statistics over
# the training images (read in chunks), and the test set's evaluation transforms (resize, normalize) on the way
MODEL = {"fedavg": "mlp", "scala": "alexnet"}  # SCALA cuts AlexNet at s2 (28×28 inputs after resize)


def run_rows(tmp_path: Path, name: str, *argv: str) -> list[dict]:
    main(["run", *RUN, *argv, "--out", str(tmp_path / name)])
    return without_timings(tmp_path / name)


@pytest.mark.parametrize("algo", ["fedavg", "scala"])
def test_a_streamed_run_equals_the_in_memory_run_with_0_or_2_loader_workers(tree, tmp_path, algo):
    """The lazy source reads exactly the images and labels the in-memory tensors hold, in the
    client's own batch order, and touches no random stream (augmentation draws the same)."""
    root, _ = tree
    spec = "imagefolder(image_size=32)"
    decoded = fedlt.datasets.load(spec, root=root)
    held = InMemoryDataset("held", decoded.x_train.take(slice(None)), decoded.y_train,
                           decoded.x_test.take(slice(None)), decoded.y_test, decoded.num_classes)
    common = ["--algo", algo, "--model", MODEL[algo]]
    with fedlt.datasets.REGISTRY.temporary("held", lambda root=None, download=False: held):
        in_memory = run_rows(tmp_path, "memory", *common, "--dataset", "held")
    streamed = [run_rows(tmp_path, f"files{w}", *common, "--dataset", spec, "--data-root", str(root),
                         "--loader-workers", str(w)) for w in (0, 2)]
    assert streamed[0] == in_memory and streamed[1] == in_memory
    assert in_memory[-1]["accuracy"] is not None and len(in_memory) == 2


def test_worker_processes_decode_their_own_clients_files(tree, tmp_path):
    """fedlt.parallel's workers receive the paths and decode themselves: the same rows as one process."""
    root, _ = tree
    argv = ["--algo", "fedavg", "--model", "mlp", "--dataset", "imagefolder(image_size=16)", "--data-root", str(root),
            "--loader-workers", "2", "--threads", "1"]
    assert run_rows(tmp_path, "parallel", *argv, "--workers", "2") == run_rows(tmp_path, "one", *argv)


def test_the_flower_client_app_slices_its_partition_from_the_files(tree):
    """A node's client data is the same files (nothing decoded crosses), decoding to the engine's tensors."""
    import types

    from fedlt.flower.client_work import client_data

    root, _ = tree
    data = fedlt.datasets.load("imagefolder(image_size=16)", root=root)
    idx = [5, 0, 17, 3]
    prep = types.SimpleNamespace(config=types.SimpleNamespace(device="cpu"), data=data,
                                 train_indices={2: np.array(idx)},  # what the client trains on (its partition's part)
                                 counts=torch.zeros(3, 3, dtype=torch.int64))
    client = client_data(prep, 2, types.SimpleNamespace(node_config={"partition-id": 2}))
    assert isinstance(client.x, FileImages) and len(client) == 4
    x, y = client.take(torch.arange(4))
    assert torch.equal(x, data.x_train.take(torch.tensor(idx))) and torch.equal(y, data.y_train[idx])


# -- the cache ------------------------------------------------------------------------------------
def test_the_cache_keeps_what_was_decoded_and_a_changed_file_gets_a_new_entry(tmp_path, monkeypatch):
    root = tmp_path / "data"
    write_tree(root, n_train=12, n_test=6)
    cache = tmp_path / "cache"
    spec = f"imagefolder(image_size=10, cache='{cache}')"
    first = fedlt.datasets.load(spec, root=root)
    assert not cache.exists()  # made when the first decoded image is kept, not when the dataset opens
    decoded = first.x_train.take(slice(None))
    first.x_test.take(slice(None))
    stored = sorted(cache.glob("*.npy"))
    assert len(stored) == 2  # one per split
    train_file = next(p for p in stored if np.load(p, mmap_mode="r").shape[0] == 12)
    assert np.array_equal(np.load(train_file, mmap_mode="r"), first.x_train.files.read(np.arange(12)))

    def refuse(*args, **kwargs):
        raise AssertionError("decoded although cached")

    monkeypatch.setattr(imagefolder_module, "decode", refuse)
    again = fedlt.datasets.load(spec, root=root)  # statistics and pixels from the cache
    assert (again.x_train.mean, again.x_train.std) == (first.x_train.mean, first.x_train.std)
    assert torch.equal(again.x_train.take(slice(None)), decoded)
    monkeypatch.undo()
    changed = root / "train" / "c0" / "000.jpg"
    Image.fromarray(np.zeros((30, 30, 3), dtype=np.uint8)).save(changed)
    fedlt.datasets.load(spec, root=root).x_train.take(slice(None))
    assert len(list(cache.glob("*.npy"))) == 3  # the changed list has its own entry; the old one stays valid


# -- bad input: one line, exit 2 ------------------------------------------------------------------
def bad_case(root: Path, case: str) -> tuple[list[str], str]:
    """Break a fresh tree in one way; the dataset flags and the message expected."""
    written = write_tree(root, n_train=9, n_test=6)
    train_list, test_list = write_lists(root, written)
    lists = f"train_list='{train_list}', test_list='{test_list}'"
    listed = root / train_list
    lines = listed.read_text().splitlines()
    if case == "missing image":
        (root / lines[0].split()[0]).unlink()
        return [f"imagefolder({lists})"], f"no image at {root / lines[0].split()[0]} ({listed} line 1)"
    if case == "not an image":
        (root / lines[4].split()[0]).write_text("a note, not a picture")
        return [f"imagefolder({lists})"], f"({listed} line 5) is not an image"
    if case == "empty image":
        (root / lines[1].split()[0]).write_bytes(b"")
        return [f"imagefolder({lists})"], "is not an image (JPEG, PNG, GIF, BMP, WebP, TIFF, PPM/PGM): the file is empty"
    if case == "line without a label":
        listed.write_text("\n".join([lines[0], "train/c0/000.jpg"] + lines[2:]))
        return [f"imagefolder({lists})"], "line 2: expected '<image path> <label>', got 'train/c0/000.jpg'"
    if case == "negative label":
        listed.write_text("\n".join(lines[:2] + [lines[2].rsplit(None, 1)[0] + " -1"] + lines[3:]))
        return [f"imagefolder({lists})"], "line 3: label '-1' is not a class index"
    if case == "missing list":
        return [f"imagefolder(train_list='nowhere.txt', test_list='{test_list}')"], f"train_list: no file at {root / 'nowhere.txt'}"
    if case == "one list":
        return [f"imagefolder(train_list='{train_list}')"], "give both train_list and test_list, or neither"
    if case == "test class unknown":
        (root / "test" / "zebra").mkdir()
        (root / "test" / "c0" / "000.jpg").rename(root / "test" / "zebra" / "000.jpg")
        return ["imagefolder"], f"{root / 'test' / 'zebra'} is not a class of the training split"
    if case == "no train folder":
        (root / "train").rename(root / "elsewhere")
        return ["imagefolder"], f"no folder {root / 'train'}"
    if case == "empty class folder":
        (root / "train" / "c9").mkdir()
        return ["imagefolder"], f"{root / 'train' / 'c9'} holds no images"
    if case == "image size":
        return ["imagefolder(image_size=0)"], "image_size must be an integer in 1..4096, got 0"
    if case == "two channels":
        return ["imagefolder(channels=2)"], "channels must be 1 (grey) or 3 (RGB), got 2"
    if case == "mean without std":
        return ["imagefolder(mean=(0.5, 0.5, 0.5))"], "give both mean and std, or neither"
    if case == "unknown parameter":
        return ["imagefolder(imgsize=3)"], "got an unexpected keyword argument 'imgsize'"
    raise ValueError(case)


CASES = ["missing image", "not an image", "empty image", "line without a label", "negative label", "missing list",
         "one list", "test class unknown", "no train folder", "empty class folder", "image size", "two channels",
         "mean without std", "unknown parameter"]


@pytest.mark.parametrize("case", CASES)
def test_bad_files_and_settings_are_one_line_and_exit_2(tmp_path, capsys, case):
    root = tmp_path / "data"
    root.mkdir()
    dataset, message = bad_case(root, case)
    err = fails_cleanly(["run", "--dataset", *dataset, "--data-root", str(root), "--algo", "fedavg", "--model", "mlp",
                         "--clients", "2", "--rounds", "1", "--quiet", "--out", str(tmp_path / "run")],
                        capsys, tmp_path / "run")
    assert message in err, err


@pytest.mark.parametrize("loader_workers", [0, 2])
def test_an_image_that_fails_to_decode_mid_run_is_one_line_naming_it(tmp_path, capsys, loader_workers):
    """A file that starts like a JPEG but is cut short passes the opening check and fails when a
    minibatch needs it: in a loader worker or not, one line naming the file and its list line."""
    root = tmp_path / "data"
    root.mkdir()
    written = write_tree(root, n_train=9, n_test=6)
    train_list, test_list = write_lists(root, written)
    lines = (root / train_list).read_text().splitlines()
    victim = next(line.split()[0] for line in lines if ".jpg " in line)
    number = next(i for i, line in enumerate(lines, 1) if line.startswith(victim + " "))
    (root / victim).write_bytes((root / victim).read_bytes()[:40])
    argv = ["run", "--dataset", f"imagefolder(image_size=8, train_list='{train_list}', test_list='{test_list}', "
            "mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25))", "--data-root", str(root), "--algo", "fedavg",
            "--model", "mlp", "--clients", "1", "--partition", "iid", "--rounds", "1", "--local-epochs", "1",
            "--loader-workers", str(loader_workers), "--quiet", "--out", str(tmp_path / "run")]
    err = fails_cleanly(argv, capsys, tmp_path / "run")
    assert f"cannot decode {root / victim} ({root / train_list} line {number})" in err, err


def test_the_api_raises_fedlt_errors_for_bad_settings(tmp_path):
    write_tree(tmp_path, n_train=6, n_test=3)
    for params, message in (({"fit": "squash"}, "fit must be crop or stretch"),
                            ({"mean": (0.5,), "std": (0.2,)}, "mean must be 3 finite number(s)"),
                            ({"mean": (0.5, 0.5, 0.5), "std": (0.2, 0.0, 0.2)}, "std must be 3 finite number(s) > 0"),
                            ({"download": True}, "--download does not apply")):
        with pytest.raises(FedltError, match=message.replace("(", r"\(").replace(")", r"\)")):
            fedlt.datasets.create("imagefolder", root=tmp_path, **params)
    with pytest.raises(FedltError, match="needs --data-root"):
        fedlt.datasets.create("imagefolder")
