"""How the authors' code (krumpguo/FedVLS, the copy prepare.sh made) is found and run offline:
its command line for the paper's MNIST setting, its folder, its commit, the modules it imports
and never uses (stubbed), torchvision's downloads forbidden. Shared by run_authors.py and
export.py, which import this module and never each other.
"""

from __future__ import annotations

import contextlib
import os
import sys
import types
from pathlib import Path

from fedlt.errors import FedltError

ALGOS = ("FedAvg", "FedLogitCal", "FedVLS")
SERVER_MODULES = {"FedAvg": "serveravg", "FedLogitCal": "serverlogitcal", "FedVLS": "servervls"}


def authors_command(work: Path, algo: str, alpha: float, *, rounds: int = 50, clients: int = 10,
                    weight_decay: float = 0.0, extra: list[str] | None = None) -> list[str]:
    """The README's FedVLS command adapted to the paper's MNIST setting (CPU). ``-ed`` is the
    weight decay of FedAvg's and FedLogitCal's clients; FedVLS's client forces 0 whatever it says."""
    cmd = ["-lbs", "64", "-nc", str(clients), "-jr", "1", "-nb", "10", "-data", "mnist", "-m", "dnn", "-algo", algo,
           "-gr", str(rounds), "-dev", "cpu", "-lr", "0.01", "-partition", "noniid", "-al", f"{alpha:g}",
           "-ls", "5", "-ed", f"{weight_decay:g}", "-dd", str(work) + "/"]
    if algo == "FedVLS":
        cmd += ["-lam", "0.1"]
    return cmd + list(extra or [])


def authors_system(work: Path) -> Path:
    """WORK/authors/system, the patched copy prepare.sh made (FedltError when it is missing)."""
    system = work / "authors" / "system"
    if not (system / "main.py").is_file():
        raise FedltError(f"--work {work}: no authors' code at {system}/main.py; run prepare.sh first")
    if not (work / "rawdata" / "MNIST" / "raw" / "train-images-idx3-ubyte").is_file():
        raise FedltError(f"--work {work}: no MNIST idx files under {work}/rawdata/MNIST/raw; run prepare.sh first")
    return system


def authors_commit(work: Path) -> str:
    return (work / "authors" / "COMMIT").read_text().split()[-1]


def prepare_imports(system: Path) -> None:
    """Make the authors' modules importable offline: their folder on sys.path, three modules they
    import and never use on MNIST stubbed, torchvision's downloads forbidden."""
    sys.path.insert(0, str(system))
    for unused in ("cv2", "h5py"):  # imported by data/meta_dataset.py (PACS) and utils/result_utils.py, unused here
        sys.modules[unused] = types.ModuleType(unused)
    calmsize = types.ModuleType("calmsize")
    # imported by utils/mem_utils.py, whose memory report (after the run) formats it with {:.2f}
    calmsize.size = lambda n: float(n)
    sys.modules["calmsize"] = calmsize

    import torchvision

    def no_download(self):
        if not self._check_exists():
            raise RuntimeError(f"MNIST idx files missing under {self.raw_folder}; run prepare.sh (no downloads)")

    torchvision.datasets.MNIST.download = no_download


@contextlib.contextmanager
def inside(system: Path):
    """Run from the authors' folder, as their README does (their results go to ../results/)."""
    before = Path.cwd()
    os.chdir(system)
    try:
        yield
    finally:
        os.chdir(before)
