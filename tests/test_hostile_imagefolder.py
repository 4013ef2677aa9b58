"""Hostile image trees, list files and caches (issue 35): every case is one line and exit 2 with
nothing created, or — where the data can be read honestly — the same images as a clean tree:
links are followed only inside the data root and each real file is listed once (a loop
``train/c0/loop -> ..`` once gave 492 images for 12), FIFOs and devices are refused by name
without being opened (they used to hang), list files are bounded and NUL-free, and a damaged
cache is rebuilt to exactly what a run without a cache reads."""

from __future__ import annotations

import gc
import json
import os
import signal
import warnings
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

import fedlt.cli
import fedlt.datasets
import fedlt.engine
import fedlt.run.parts
from fedlt.datasets import imagefolder as imagefolder_module
from fedlt.datasets.base import MAX_CLASSES
from fedlt.errors import FedltError

from conftest import without_timings
from test_hostile_inputs import fails_cleanly
from test_imagefolder import write_lists, write_tree

pytestmark = pytest.mark.usefixtures("one_thread")

RUN = ["--algo", "fedavg", "--model", "mlp", "--clients", "2", "--partition", "iid", "--rounds", "1",
       "--local-iters", "1", "--quiet"]


@contextmanager
def deadline(seconds: int = 20):
    """A case that would block (opening a FIFO) fails instead of hanging the suite."""
    def expired(signum, frame):
        raise TimeoutError(f"blocked for {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def cli_refuses(tmp_path: Path, capsys, dataset: str, root: Path, *extra: str) -> str:
    """``fedlt run`` on the dataset: exit 2, one line, and nothing under tmp_path/work (the run
    directory and any cache live there)."""
    work = tmp_path / "work"
    with deadline():
        return fails_cleanly(["run", "--dataset", dataset, "--data-root", str(root), *RUN, *extra,
                              "--out", str(work / "run")], capsys, work)


@pytest.fixture
def root(tmp_path) -> Path:
    root = tmp_path / "data"
    write_tree(root, n_train=12, n_test=6)
    return root


# -- walking the tree ------------------------------------------------------------------------------
LINKS = {  # name: (link path under the root, target), the real images stay 12 + 6
    "loop to the split": ("train/c0/loop", ".."),
    "loop to itself": ("train/c1/self", "."),
    "loop to its own class": ("train/c2/deep/up", "../.."),
    "two classes linked to each other": ("train/c0/other", "../c1"),
    "a second link to a file": ("train/c0/twin.png", "../c1/001.png"),
    "a dangling link": ("train/c2/gone.png", "nowhere.png"),
}


def add_link(root: Path, case: str) -> None:
    where, target = LINKS[case]
    (root / where).parent.mkdir(parents=True, exist_ok=True)
    os.symlink(target, root / where)
    if case == "two classes linked to each other":
        os.symlink("../c0", root / "train/c1/back")


@pytest.mark.parametrize("case", LINKS)
def test_links_inside_the_root_list_each_real_file_once(root, case):
    clean = fedlt.datasets.load("imagefolder(image_size=8)", root=root)
    add_link(root, case)
    with deadline():
        linked = fedlt.datasets.load("imagefolder(image_size=8)", root=root)
    assert len(linked.x_train) == len(clean.x_train) == 12 and len(linked.x_test) == 6
    assert torch.equal(linked.y_train, clean.y_train)
    assert linked.x_train.files.listing.paths.tolist() == clean.x_train.files.listing.paths.tolist()


def test_a_double_loop_of_links_ends_and_lists_each_file_once(root):
    os.symlink("../c1", root / "train/c0/a")
    os.symlink("../c0/a", root / "train/c1/b")  # a -> c1, whose b -> c0/a -> c1 ...
    (root / "train/c2/x").mkdir()
    os.symlink("y", root / "train/c2/x/z")
    os.symlink("z", root / "train/c2/x/y")  # y -> z -> y: a link loop the OS refuses (ELOOP)
    with deadline():
        data = fedlt.datasets.load("imagefolder(image_size=8)", root=root)
    assert len(data.x_train) == 12


@pytest.mark.parametrize("where", ["train/c0/out", "train/c0/out.png", "train/c3"])
def test_a_link_out_of_the_root_is_one_line_naming_it(root, tmp_path, capsys, where):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "secret.png").write_bytes((root / "train/c1/001.png").read_bytes())
    os.symlink(outside / "secret.png" if where.endswith(".png") else outside, root / where)
    err = cli_refuses(tmp_path, capsys, "imagefolder(image_size=8)", root)
    assert f"{root / where} is a link to {outside}" in err and "outside --data-root" in err, err


@pytest.mark.parametrize("kind", ["fifo in the tree", "fifo in a list", "fifo as the list", "device as the list",
                                  "device in a list", "folder in a list"])
def test_fifos_and_devices_are_refused_by_name_without_opening_them(root, tmp_path, capsys, kind):
    train_list, test_list = write_lists(root, {"train": [(f"train/c{i % 3}/{i:03d}.{'png' if i % 2 else 'jpg'}", i % 3)
                                                         for i in range(12)],
                                               "test": [(f"test/c{i % 3}/{i:03d}.{'png' if i % 2 else 'jpg'}", i % 3)
                                                        for i in range(6)]})
    lists = f"train_list='{train_list}', test_list='{test_list}', image_size=8"
    spec, named, what = f"imagefolder({lists})", None, None
    if kind == "fifo in the tree":
        named, what = root / "train/c0/x.png", "a FIFO (named pipe)"
        os.mkfifo(named)
        spec = "imagefolder(image_size=8)"
    elif kind == "fifo in a list":
        named, what = root / "pipe.png", "a FIFO (named pipe)"
        os.mkfifo(named)
        (root / train_list).write_text(f"pipe.png 0\n{(root / train_list).read_text()}")
    elif kind == "fifo as the list":
        named, what = root / "pipe.txt", "a FIFO (named pipe)"
        os.mkfifo(named)
        spec = f"imagefolder(train_list='pipe.txt', test_list='{test_list}')"
    elif kind == "device as the list":
        named, what = Path("/dev/zero"), "a character device"
        spec = f"imagefolder(train_list='/dev/zero', test_list='{test_list}')"
    elif kind == "device in a list":
        named, what = Path("/dev/zero"), "a character device"
        (root / train_list).write_text(f"/dev/zero 0\n{(root / train_list).read_text()}")
    else:
        named, what = root / "train/c0", "a folder"
        (root / train_list).write_text(f"train/c0 0\n{(root / train_list).read_text()}")
    err = cli_refuses(tmp_path, capsys, spec, root)
    assert f"{named}" in err and f"is {what}" in err, err


# -- list files ------------------------------------------------------------------------------------
def lists_of(root: Path) -> tuple[str, str]:
    written = {split: [(str(p.relative_to(root)), int(p.parent.name[1:])) for p in sorted((root / split).rglob("*.*"))]
               for split in ("train", "test")}
    return write_lists(root, written)


@pytest.mark.parametrize("label", [str(MAX_CLASSES), "10000000", str(2**31), str(2**63), "9" * 5000])
def test_labels_beyond_the_class_bound_are_one_line_naming_the_label_and_the_bound(root, tmp_path, capsys, label):
    train_list, test_list = lists_of(root)
    lines = (root / train_list).read_text().splitlines()
    lines[1] = f"{lines[1].rsplit(None, 1)[0]} {label}"
    (root / train_list).write_text("\n".join(lines))
    err = cli_refuses(tmp_path, capsys, f"imagefolder(train_list='{train_list}', test_list='{test_list}')", root)
    assert f"line 2: label '{label[:20]}" in err and f"beyond the {MAX_CLASSES} classes" in err, err
    assert len(err) < 400, err


def test_a_nul_byte_is_refused_naming_its_line(root, tmp_path, capsys):
    train_list, test_list = lists_of(root)
    text = (root / train_list).read_text().splitlines()
    text[2] = text[2].replace(".", "\0.", 1)
    (root / train_list).write_text("\n".join(text))
    err = cli_refuses(tmp_path, capsys, f"imagefolder(train_list='{train_list}', test_list='{test_list}')", root)
    assert f"{root / train_list} line 3 holds a NUL byte" in err, err


def test_a_list_beyond_the_size_bound_is_refused_before_it_is_read(root, tmp_path, capsys, monkeypatch):
    train_list, test_list = lists_of(root)
    monkeypatch.setattr(imagefolder_module, "MAX_LIST_BYTES", 64)
    err = cli_refuses(tmp_path, capsys, f"imagefolder(train_list='{train_list}', test_list='{test_list}')", root)
    assert f"beyond the 64 a list file may hold" in err, err


def test_a_byte_order_mark_is_not_part_of_the_first_path(root):
    train_list, test_list = lists_of(root)
    for name in (train_list, test_list):
        (root / name).write_bytes(b"\xef\xbb\xbf" + (root / name).read_bytes())
    marked = fedlt.datasets.load(f"imagefolder(image_size=8, train_list='{train_list}', test_list='{test_list}')",
                                 root=root)
    first = os.fsdecode(marked.x_train.files.listing.paths[0])
    assert first == str(root / (root / train_list).read_text(encoding="utf-8-sig").split()[0])


# -- the cache -------------------------------------------------------------------------------------
def spoil(cache: Path, case: str) -> None:
    """Damage the training split's cache files in one way."""
    stats = next(cache.glob("*.stats.json"))
    npy = cache / stats.name.replace(".stats.json", ".npy")
    saved = json.loads(stats.read_text())
    if case == "stats of the wrong length":
        stats.write_text(json.dumps({**saved, "mean": saved["mean"][:2]}))
    elif case == "stats not JSON":
        stats.write_text("{mean: oops")
    elif case == "stats missing a key":
        stats.write_text(json.dumps({"mean": saved["mean"]}))
    elif case == "stats as strings":
        stats.write_text(json.dumps({**saved, "std": ["0.2", "0.2", "0.2"]}))
    elif case == "NaN std":
        stats.write_text(json.dumps({**saved, "std": [float("nan")] * 3}))
    elif case == "zero std":
        stats.write_text(json.dumps({**saved, "std": [0.0] * 3}))
    elif case == "stats edited, digest kept":
        stats.write_text(json.dumps({**saved, "mean": [0.9, 0.9, 0.9]}))
    elif case == "flipped pixels":
        data = bytearray(npy.read_bytes())
        for at in (len(data) - 1, len(data) // 2, 200):
            data[at] ^= 0xFF
        npy.write_bytes(bytes(data))
    elif case == "truncated npy":
        npy.write_bytes(npy.read_bytes()[:-50])
    elif case == "bad npy header":
        data = npy.read_bytes()
        npy.write_bytes(data[:10] + b"{'descr': '<f8'," + data[26:])
    elif case == "not an npy":
        npy.write_text("hello")
    elif case == "npy deleted, flags kept":
        npy.unlink()
    else:
        raise ValueError(case)


SPOILS = ["stats of the wrong length", "stats not JSON", "stats missing a key", "stats as strings", "NaN std",
          "zero std", "stats edited, digest kept", "flipped pixels", "truncated npy", "bad npy header", "not an npy",
          "npy deleted, flags kept"]


@pytest.fixture(scope="module")
def cached(tmp_path_factory) -> tuple[Path, torch.Tensor, torch.Tensor, tuple]:
    """A tree and what a run without a cache reads from it (train and test, standardised)."""
    root = tmp_path_factory.mktemp("cached") / "data"
    write_tree(root, n_train=12, n_test=6)
    plain = fedlt.datasets.load("imagefolder(image_size=8)", root=root)
    return root, plain.x_train.take(slice(None)), plain.x_test.take(slice(None)), (plain.x_train.mean,
                                                                                   plain.x_train.std)


@pytest.mark.parametrize("case", SPOILS)
def test_a_damaged_cache_is_rebuilt_to_what_a_run_without_it_reads(cached, tmp_path, case):
    root, train, test, stats = cached
    spec = f"imagefolder(image_size=8, cache='{tmp_path / 'cache'}')"
    first = fedlt.datasets.load(spec, root=root)
    first.x_train.take(slice(None)), first.x_test.take(slice(None))  # fills the cache, writes the statistics
    spoil(tmp_path / "cache", case)
    again = fedlt.datasets.load(spec, root=root)
    assert (again.x_train.mean, again.x_train.std) == stats
    assert torch.equal(again.x_train.take(slice(None)), train) and torch.equal(again.x_test.take(slice(None)), test)
    third = fedlt.datasets.load(spec, root=root)  # the rebuilt cache is whole: nothing is decoded
    orig = imagefolder_module.decode
    try:
        imagefolder_module.decode = lambda *a, **k: (_ for _ in ()).throw(AssertionError("decoded"))
        assert torch.equal(third.x_train.take(slice(None)), train)
    finally:
        imagefolder_module.decode = orig


def test_each_cached_row_is_checked_when_read(cached, tmp_path):
    root, train, _, _ = cached
    spec = f"imagefolder(image_size=8, cache='{tmp_path / 'cache'}')"
    data = fedlt.datasets.load(spec, root=root)
    data.x_train.take(slice(None))
    store = data.x_train.files.cache
    assert all(store.get(i) is not None for i in range(12))
    with open(store.npy, "r+b") as f:  # one pixel of row 5, behind the open file descriptors' back
        f.seek(store.offset + 5 * store.row + 7)
        value = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([value[0] ^ 1]))
    assert store.get(5) is None and store.get(4) is not None  # read as absent: decoded again
    assert torch.equal(data.x_train.take(slice(None)), train)
    assert store.get(5) is not None


@pytest.mark.parametrize("case", ["bad mean", "empty test image", "bad split for the model", "unreadable cache"])
def test_a_refused_run_leaves_no_cache_behind(root, tmp_path, capsys, case):
    cache = tmp_path / "work" / "cache"
    spec, extra = f"imagefolder(image_size=8, cache='{cache}')", []
    if case == "bad mean":
        spec, named = f"imagefolder(image_size=8, cache='{cache}', mean=(0.5, 0.5), std=(0.2, 0.2))", "mean must be 3"
    elif case == "empty test image":
        (root / "test/c1/001.png").write_bytes(b"")
        named = "the file is empty"
    elif case == "bad split for the model":
        spec = f"imagefolder(image_size=32, cache='{cache}')"
        extra, named = ["--model", "alexnet", "--split", "s9"], "is not a split point of alexnet"
    else:
        (tmp_path / "work").mkdir()
        cache.write_text("a file, not a folder")
        named = f"cache {cache} is not a folder"
    if case == "unreadable cache":
        before = cache.read_text()
        with pytest.raises(SystemExit) as info:
            fedlt.cli.main(["run", "--dataset", spec, "--data-root", str(root), *RUN, "--out", str(tmp_path / "run")])
        err = capsys.readouterr().err.strip()
        assert info.value.code == 2 and len(err.splitlines()) == 1 and named in err, err
        assert cache.read_text() == before and not (tmp_path / "run").exists()
        return
    err = cli_refuses(tmp_path, capsys, spec, root, *extra)  # a flag given twice: the last one counts
    assert named in err, err


# -- a dead loader process -------------------------------------------------------------------------
def _is_loader(obj: object) -> bool:
    """Whether ``obj`` is a DataLoader; a weak proxy whose referent died (an earlier test's, in this
    worker process: dynamo's, after a compiled step) raises ReferenceError on isinstance."""
    try:
        return isinstance(obj, torch.utils.data.DataLoader)
    except ReferenceError:
        return False


def kill_a_loader_worker(root: Path) -> int:
    """SIGKILL one worker process of a live fedlt DataLoader over ``root``'s images (found among
    the live objects: an earlier test's loaders may still be alive)."""
    with warnings.catch_warnings():  # isinstance on some live objects warns of torch deprecations
        warnings.simplefilter("ignore")
        loaders = [obj for obj in gc.get_objects() if _is_loader(obj)]
    for obj in loaders:
        decoder = obj.dataset
        if isinstance(decoder, imagefolder_module._Decoder) and os.fsdecode(decoder.files.listing.paths[0]).startswith(
                f"{root}{os.sep}"):
            workers = getattr(getattr(obj, "_iterator", None), "_workers", None)
            if workers and all(w.is_alive() for w in workers):
                os.kill(workers[0].pid, signal.SIGKILL)
                return workers[0].pid
    raise AssertionError("no live loader worker")


def test_a_killed_loader_process_is_named_and_the_run_resumes_exactly(root, tmp_path, capsys):
    argv = ["run", "--dataset", "imagefolder(image_size=8, mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25))",
            "--data-root", str(root), "--algo", "fedavg", "--model", "mlp", "--clients", "2", "--partition", "iid",
            "--rounds", "3", "--local-iters", "1", "--batch-size", "4", "--loader-workers", "2", "--quiet"]
    fedlt.cli.main([*argv, "--out", str(tmp_path / "whole")])
    killed = []
    real = fedlt.run.parts.train_round  # what the round loop calls

    def round_then_kill(algorithm, ctx, round_index, *args, **kwargs):
        if round_index == 2 and not killed:  # round 1 started the loaders
            killed.append(kill_a_loader_worker(root))
        return real(algorithm, ctx, round_index, *args, **kwargs)

    fedlt.run.parts.train_round = round_then_kill
    try:
        with pytest.raises(SystemExit) as info:
            fedlt.cli.main([*argv, "--out", str(tmp_path / "cut")])
    finally:
        fedlt.run.parts.train_round = real
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and len(err.splitlines()) == 1, err
    assert f"--loader-workers process decoding the images died (pid {killed[0]}, killed by SIGKILL)" in err, err
    assert "Connection reset" not in err
    fedlt.cli.main(["run", "--resume", str(tmp_path / "cut"), "--quiet"])
    assert without_timings(tmp_path / "cut") == without_timings(tmp_path / "whole")


def test_the_api_refuses_a_fifo_list_without_blocking(root):
    os.mkfifo(root / "pipe.txt")
    with deadline(), pytest.raises(FedltError, match="is a FIFO"):
        fedlt.datasets.create("imagefolder", root=root, train_list="pipe.txt", test_list="pipe.txt")
