"""The FedVLS authors' own MNIST client data, exported into fedlt's formats (issue 25).

Runs the authors' ``main.py`` (the temporary copy prepare.sh made) with the same command line as
``run_authors.py --data authors``, so their ``generate_mnist`` draws exactly what it draws in their
runs (numpy seeded 1 at import; sklearn's ``train_test_split`` and their Dirichlet loop on numpy's
global stream), records WHICH of the pooled 70k MNIST images each draw picked, and stops once the
loaders exist. It writes, under ``--out`` (default WORK/authors-data):

  mnist-authors.npz   an ``arrays`` dataset: x_train / y_train = the authors' 75 % training split
                      (52 500 images in their order; every one belongs to a client), x_test / y_test
                      = their 25 % held-out split, raw uint8 (N, 28, 28), so fedlt's own
                      standardisation applies; groups_train = each image's client (0..K-1)
  partition.npz       a fedlt partition file: client k = exactly the authors' client k's samples,
                      in their order (indices into x_train); its manifest beside it (.json)
  export.json         what was run, sizes, per-client class counts, the sha256, both normalisations

Nothing about the draws is changed: the hooks pass one extra array of positions through the
authors' own ``train_test_split`` (one permutation, whatever the number of arrays) and index
positions instead of images in their ``separate_data`` (which only indexes its first argument).
Before writing, the authors' client and held-out loaders are checked, tensor for tensor, against
their normalisation of the exported images.

    python export.py --work /tmp/fedvls_repro [--out DIR] [--alpha 0.05] [--clients 10]
"""

from __future__ import annotations

import argparse
import json
import runpy
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedlt.datasets.arrays import channel_statistics
from fedlt.errors import FedltError
from fedlt.partitioners import Partition

AUTHORS_MEAN_STD = (0.5, 0.5)  # their transforms.Normalize([0.5], [0.5])


def authors_normalise(images_uint8: np.ndarray) -> torch.Tensor:
    """ToTensor + Normalize(0.5, 0.5) as torchvision computes it, float32 (N, 1, H, W)."""
    x = torch.from_numpy(np.ascontiguousarray(images_uint8)).to(torch.float32).div(255).unsqueeze(1)
    mean, std = AUTHORS_MEAN_STD
    return x.sub_(mean).div_(std)


class SplitRecorder:
    """Hooks on the authors' ``data.generate_mnist`` module that record the positions behind each
    draw, without changing any draw (see the module docstring).

    After ``generate_mnist`` ran: ``pooled`` (the normalised images it split), ``train_positions`` /
    ``test_positions`` (into the pooled set, in the split's order) and ``client_positions`` (one
    int64 array per client, into the training split, in the authors' order).
    """

    def __init__(self) -> None:
        self.pooled: np.ndarray | None = None
        self.pooled_labels: np.ndarray | None = None
        self.train_positions: np.ndarray | None = None
        self.test_positions: np.ndarray | None = None
        self.client_positions: list[np.ndarray] | None = None

    def install(self, module: Any) -> None:
        split, separate = module.train_test_split, module.separate_data

        def train_test_split(x, y, *args, **kwargs):
            x_tr, x_te, y_tr, y_te, p_tr, p_te = split(x, y, np.arange(len(y)), *args, **kwargs)
            self.pooled, self.pooled_labels = x, np.asarray(y)
            self.train_positions, self.test_positions = np.asarray(p_tr), np.asarray(p_te)
            return x_tr, x_te, y_tr, y_te

        def separate_data(data, *args, **kwargs):
            content, labels = data
            positions, y, statistic = separate((np.arange(len(labels)), labels), *args, **kwargs)
            self.client_positions = [np.asarray(p, dtype=np.int64).reshape(-1) for p in positions]
            return [content[p] for p in self.client_positions], y, statistic

        module.train_test_split, module.separate_data = train_test_split, separate_data

    def sha256(self) -> str:
        from fedlt.partitioners.base import indices_sha256

        return indices_sha256(self.client_positions)


def _stacked(dataset) -> tuple[torch.Tensor, torch.Tensor]:
    """The authors' loader datasets are lists of (image, label) tensors."""
    return torch.stack([x for x, _ in dataset]), torch.stack([y for _, y in dataset])


def check_loaders(recorder: SplitRecorder, client_loaders: dict, held_out_loader, pooled_uint8: np.ndarray,
                  pooled_labels: np.ndarray) -> None:
    """Refuse (FedltError) an export whose images are not, tensor for tensor, what the authors'
    loaders hold: client k's loader = their normalisation of the pooled images at
    train_positions[client_positions[k]], the held-out loader = those at test_positions."""
    if recorder.client_positions is None or recorder.train_positions is None:
        raise FedltError("export: the authors' generate_mnist did not call train_test_split and separate_data "
                         "(not the pipeline this exporter knows: krumpguo/FedVLS commit 7d8163f)")
    if recorder.pooled is not None and not torch.equal(torch.as_tensor(recorder.pooled).reshape(-1, 1, *pooled_uint8.shape[1:]),
                                                       authors_normalise(pooled_uint8)):
        raise FedltError("export: the images the authors' code pooled are not the raw MNIST files under "
                         "WORK/rawdata/MNIST/raw normalised with (0.5, 0.5)")
    expected = [("held-out set", held_out_loader.dataset, recorder.test_positions)]
    expected += [(f"client {k}", client_loaders[k].dataset, recorder.train_positions[p])
                 for k, p in enumerate(recorder.client_positions)]
    for what, dataset, positions in expected:
        x, y = _stacked(dataset)
        if not (torch.equal(x.reshape(len(positions), -1), authors_normalise(pooled_uint8[positions]).reshape(len(positions), -1))
                and np.array_equal(y.numpy(), pooled_labels[positions])):
            raise FedltError(f"export: the authors' {what} does not hold the images at the recorded positions")


def build_export(pooled_uint8: np.ndarray, pooled_labels: np.ndarray, recorder: SplitRecorder,
                 num_classes: int, params: dict[str, Any]) -> tuple[dict[str, np.ndarray], Partition]:
    """The ``arrays`` dataset (raw uint8) and the partition, from what ``recorder`` saw."""
    train, test = recorder.train_positions, recorder.test_positions
    clients = recorder.client_positions
    owner = np.full(train.size, -1, dtype=np.int64)
    for k, p in enumerate(clients):
        if np.any(owner[p] >= 0) or np.unique(p).size != p.size:
            raise FedltError(f"export: client {k} shares samples with another client; the authors' split "
                             "gives each sample to one client")
        owner[p] = k
    if np.any(owner < 0):  # every training image is some client's: the union is the training set
        raise FedltError(f"export: {int((owner < 0).sum())} training images belong to no client")
    y_train = pooled_labels[train].astype(np.int64)
    arrays = {"x_train": pooled_uint8[train], "y_train": y_train, "x_test": pooled_uint8[test],
              "y_test": pooled_labels[test].astype(np.int64), "groups_train": owner}
    partition = Partition.build(clients, y_train, num_classes, name="fedvls_authors", params=params,
                                seed=int(params.get("numpy_seed", 1)), dataset_name="arrays")
    return arrays, partition


def write_export(out: Path, arrays: dict[str, np.ndarray], partition: Partition, info: dict[str, Any]) -> dict:
    """mnist-authors.npz, partition.npz (+ .json manifest) and export.json under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out / "mnist-authors.npz", **arrays)
    partition.save(out / "partition.npz")
    (out / "partition.json").write_text(json.dumps(partition.manifest, indent=1))
    mean, std = channel_statistics(arrays["x_train"], False)
    info = {**info, "arrays": str(out / "mnist-authors.npz"), "partition": str(out / "partition.npz"),
            "partition_sha256": partition.sha256, "train_size": int(arrays["y_train"].size),
            "held_out_size": int(arrays["y_test"].size), "client_sizes": [len(p) for p in partition.client_indices],
            "class_counts": partition.class_counts.tolist(),
            # fedlt's arrays dataset standardises by these (the clients' pixels); the authors' code by (0.5, 0.5)
            "normalisation": {"fedlt_arrays_mean_std": [float(mean[0]), float(std[0])],
                              "authors_mean_std": list(AUTHORS_MEAN_STD)}}
    (out / "export.json").write_text(json.dumps(info, indent=1))
    return info


class _Stop(Exception):
    """Raised once generate_mnist returned: the export needs nothing main.py does afterwards."""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, required=True, help="the folder prepare.sh filled")
    parser.add_argument("--out", type=Path, default=None, help="default: WORK/authors-data")
    parser.add_argument("--alpha", type=float, default=0.05, help="the authors' -al (Dirichlet concentration)")
    parser.add_argument("--clients", type=int, default=10, help="the authors' -nc")
    args = parser.parse_args(argv)
    try:
        info = export(args.work, args.out or args.work / "authors-data", args.alpha, args.clients)
    except FedltError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    print(json.dumps({k: v for k, v in info.items() if k != "class_counts"}))


def export(work: Path, out: Path, alpha: float, clients: int) -> dict:
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    import authors as run_authors  # beside this file; it knows how the authors' main.py is run offline

    work = work.resolve()
    system = run_authors.authors_system(work)
    raw = work / "rawdata" / "MNIST" / "raw"
    run_authors.prepare_imports(system)
    import data.generate_mnist as gm  # seeds numpy at import, as main.py's own import does
    import torchvision

    recorder, seen = SplitRecorder(), {}
    recorder.install(gm)
    generate = gm.generate_mnist

    def generate_and_stop(*a, **k):
        seen["loaders"] = generate(*a, **k)
        raise _Stop

    gm.generate_mnist = generate_and_stop
    command = run_authors.authors_command(work, "FedVLS", alpha, rounds=50, clients=clients)
    sys.argv = ["main.py", *command]
    try:
        with run_authors.inside(system):
            runpy.run_path(str(system / "main.py"), run_name="__main__")
    except _Stop:
        pass
    if "loaders" not in seen:
        raise FedltError("export: the authors' main.py finished without calling generate_mnist (is -data mnist?)")
    client_loaders, held_out, _pooled_train = seen["loaders"]  # generate_mnist's own return order
    sets = [torchvision.datasets.MNIST(root=str(work / "rawdata"), train=t, download=False) for t in (True, False)]
    pooled_uint8 = np.concatenate([s.data.numpy() for s in sets])  # the order their code pools them in
    pooled_labels = np.concatenate([s.targets.numpy() for s in sets]).astype(np.int64)
    check_loaders(recorder, client_loaders, held_out, pooled_uint8, pooled_labels)
    import sklearn

    params = {"alpha": alpha, "least_samples": gm.least_samples, "train_size": gm.train_size, "numpy_seed": 1,
              "source": f"krumpguo/FedVLS@{run_authors.authors_commit(work)[:12]} generate_mnist"}
    arrays, partition = build_export(pooled_uint8, pooled_labels, recorder, 10, params)
    info = {"authors_commit": run_authors.authors_commit(work), "command": "main.py " + " ".join(command),
            "raw_mnist": str(raw), "sklearn": sklearn.__version__, "numpy": np.__version__,
            "checked": "client and held-out loaders equal the authors' normalisation of the exported images"}
    return write_export(out, arrays, partition, info)


if __name__ == "__main__":
    main()
