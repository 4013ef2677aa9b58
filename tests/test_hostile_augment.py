"""Hostile ``--augment`` parameters (issue 35): sizes, paddings, probabilities and statistics that
reached torch (a crop of size -1, a padding of 10^9 pixels, ``resize(size=0)``) or trained on
nonsense (a crop of size 0, ``p=True``, ``std=inf`` making every input 0) are one line naming the
parameter and its bound, exit 2, before anything is created."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import fedlt.augment as A
from fedlt.errors import FedltError

from test_arrays_dataset import make_arrays
from test_hostile_inputs import fails_cleanly

pytestmark = pytest.mark.usefixtures("one_thread")

SIZE = f"must be an integer 1..{A.MAX_SIDE} or two of them (height, width)"
CASES = [  # (--augment, words of the one line); the images are 6×6
    ("random_crop(padding=1000000000)", "random_crop: padding: Input should be less than or equal to 4096"),
    ("random_crop(padding=5000)", "random_crop: padding: Input should be less than or equal to 4096"),
    ("random_crop(padding=7)", "random_crop padding 7 is more than the 6×6 images' shorter side (6)"),
    ("random_crop(padding=True)", "random_crop: padding: expected a number, got a boolean (True)"),
    ("random_crop(padding=-1)", "random_crop: padding: Input should be greater than or equal to 0"),
    ("random_crop(size=-1)", f"random_crop: size: {SIZE}, got -1"),
    ("random_crop(size=0)", f"random_crop: size: {SIZE}, got 0"),
    ("random_crop(size=(4, 0))", f"random_crop: size: {SIZE}, got (4, 0)"),
    ("random_crop(size=(2, 2, 2))", f"random_crop: size: {SIZE}, got (2, 2, 2)"),
    ("random_crop(size=True)", f"random_crop: size: {SIZE}, got True"),
    ("random_crop(fill=1e999)", "random_crop: fill: Input should be a finite number"),
    ("center_crop(size=-1)", f"center_crop: size: {SIZE}, got -1"),
    ("center_crop(size=0)", f"center_crop: size: {SIZE}, got 0"),
    ("center_crop(size=7)", "center_crop size 7×7 is larger than the 6×6 images it crops"),
    ("resize(size=0)", f"resize: size: {SIZE}, got 0"),
    ("resize(size=-1)", f"resize: size: {SIZE}, got -1"),
    ("resize(size=1000000)", f"resize: size: {SIZE}, got 1000000"),
    ("resize(size=4097)", f"resize: size: {SIZE}, got 4097"),
    ("resize(size=2.5)", f"resize: size: {SIZE}, got 2.5"),
    ("hflip(p=True)", "hflip: p: expected a number, got a boolean (True)"),
    ("vflip(p=1.5)", "vflip: p: Input should be less than or equal to 1"),
    ("hflip(p=1e999)", "hflip: p: Input should be less than or equal to 1"),
    ("normalize(mean=(0, 0, 0), std=(1e999, 1, 1))", "normalize: std: must be 1..64 finite numbers"),
    ("normalize(mean=(-1e999, 0, 0), std=(1, 1, 1))", "normalize: mean: must be 1..64 finite numbers"),
    ("normalize(mean=(0, 0, 0), std=(0, 1, 1))", "normalize: std must be positive"),
    ("normalize(mean=(0, 0, 0), std=(True, 1, 1))", "normalize: std: must be 1..64 finite numbers"),
    ("normalize(mean=(), std=())", "normalize: mean: must be 1..64 finite numbers"),
    (f"normalize(mean={tuple([0] * 65)}, std={tuple([1] * 65)})", "normalize: mean: must be 1..64 finite numbers"),
]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("augment") / "d.npz"
    np.savez(path, **make_arrays(shape=(6, 6, 3)))
    return path


@pytest.mark.parametrize("spec, words", CASES, ids=[c for c, _ in CASES])
def test_a_bad_augmentation_is_one_line_naming_the_parameter_and_its_bound(data, tmp_path, capsys, spec, words):
    work = tmp_path / "work"
    err = fails_cleanly(["run", "--dataset", "arrays", "--data-root", str(data), "--algo", "fedavg", "--model", "mlp",
                         "--clients", "2", "--rounds", "1", "--local-iters", "1", "--augment", spec, "--quiet",
                         "--out", str(work / "run")], capsys, work)
    assert words in err, err
    assert len(err) < 400, err


@pytest.mark.parametrize("spec", ["random_crop(size=4096)", "resize(size=(1, 4096))", "hflip(p=0)", "hflip(p=1)",
                                  "random_crop(size=6, padding=6)", "normalize(mean=0.5, std=0.25)",
                                  "normalize(mean=[0.1, 0.2, 0.3], std=[1, 2, 3])"])
def test_values_at_the_bounds_are_accepted(spec):
    assert A.build(spec)


def test_the_api_refuses_what_the_cli_refuses():
    with pytest.raises(FedltError, match="size: must be an integer 1..4096"):
        A.build([{"name": "resize", "size": 0}])
    with pytest.raises(FedltError, match="padding 9 is more than"):
        A.build("random_crop(padding=9)").output_shape((3, 8, 8))
