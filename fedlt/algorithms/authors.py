"""The authors' training settings of each method, each with the line of their code it comes from.

fedlt's run defaults (SGD momentum 0.9, weight decay 5e-4, total gradient-norm clip 10, the last
partial batch trained) are SCALA's; most methods' authors train otherwise. An algorithm declares
here what its authors' code does, so that ``fedlt run --algo X --preset authors`` runs their
settings (explicit values still win), ``fedlt list algorithms X`` shows where fedlt's defaults
differ, and a run says in one line when its settings are not its authors'.

A setting's key is the RunConfig path it sets (``optimiser.lr``, ``local_epochs``,
``algorithm_params.head_epochs``); its source is ``repository@commit:file:line``. A plugin declares
its own with :func:`declare`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import fedlt.algorithms  # the registry (this package: loaded before this module, whoever imports it first)
from fedlt.errors import FedltError


@dataclass(frozen=True)
class Setting:
    key: str  # the RunConfig path it sets, e.g. "optimiser.momentum"
    value: Any
    source: str  # repository@commit:file:line


@dataclass(frozen=True)
class AuthorsSettings:
    algorithm: str
    code: str  # repository@commit
    settings: tuple[Setting, ...]
    note: str = ""
    # fedlt's run defaults are these settings (SCALA's): a run's other values are its user's choice,
    # not fedlt's, and no note names them
    fedlt_defaults: bool = False

    def as_config(self) -> dict[str, Any]:
        """The settings as a nested RunConfig table (``{"optimiser": {"lr": ...}, ...}``)."""
        out: dict[str, Any] = {}
        for s in self.settings:
            *parents, leaf = s.key.split(".")
            node = out
            for p in parents:
                node = node.setdefault(p, {})
            node[leaf] = s.value
        return out


AUTHORS: dict[str, AuthorsSettings] = {}
PRESETS = ("authors",)
# Why a built-in algorithm declares none (said by --preset authors and fedlt list algorithms NAME).
WHY_NONE: dict[str, str] = {}


def declare(algorithm: str, code: str, settings: dict[str, tuple[Any, str]], note: str = "",
            fedlt_defaults: bool = False) -> None:
    """Declare ``algorithm``'s authors' settings: ``{key: (value, "file:line")}``, each file of
    ``code`` (``repository@commit``; ``paper: <paper>`` where they published no code, each place
    a section, table or algorithm of it). ``fedlt_defaults``: fedlt's run defaults are these."""
    if algorithm in AUTHORS:
        raise FedltError(f"the authors' settings of {algorithm!r} are declared twice")
    AUTHORS[algorithm] = AuthorsSettings(algorithm, code, tuple(Setting(k, v, f"{code}:{where}")
                                                                for k, (v, where) in settings.items()), note,
                                         fedlt_defaults)


def authors_settings(algorithm: str) -> AuthorsSettings | None:
    return AUTHORS.get(algorithm)


def why_none(algorithm: str) -> str:
    """Why ``algorithm`` declares no authors' settings, in a few words."""
    return WHY_NONE.get(algorithm, "none declared")


def lookup(config: dict[str, Any], key: str) -> tuple[bool, Any]:
    """``(present, value)`` of a dotted ``key`` in a nested table of settings."""
    node: Any = config
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def fill(data: dict[str, Any], settings: AuthorsSettings) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """``data`` with every one of ``settings`` it does not set itself filled in (what the user set
    wins), and the settings chosen this way, ``{key: {"value": ..., "source": ...}}``."""
    chosen: dict[str, dict[str, Any]] = {}
    out = dict(data)
    for s in settings.settings:
        *parents, leaf = s.key.split(".")
        node = out
        for p in parents:
            child = node.get(p, {})
            if not isinstance(child, dict):  # a settings object given whole (Python): the user's, untouched
                break
            node[p] = node = dict(child)
        else:
            if leaf not in node:
                node[leaf] = s.value
                chosen[s.key] = {"value": s.value, "source": s.source}
    return out, chosen


def differences(algorithm: str, effective: dict[str, Any]) -> list[tuple[Setting, Any]]:
    """The authors' settings of ``algorithm`` that ``effective`` (a whole RunConfig as a table)
    does not follow: ``(their setting, the value used)`` each."""
    settings = AUTHORS.get(algorithm)
    if settings is None or settings.fedlt_defaults:
        return []
    out = []
    for s in settings.settings:
        present, value = lookup(effective, s.key)
        if not present and s.key.startswith("algorithm_params."):  # a method constant left at its default
            present, value = True, algorithm_default(algorithm, s.key.split(".", 1)[1])
        if present and not _same(value, s.value):
            out.append((s, value))
    return out


def algorithm_default(algorithm: str, param: str) -> Any:
    """The value of ``algorithm``'s parameter ``param`` when a run does not set it."""
    return getattr(fedlt.algorithms.create(algorithm), param, None)


def differences_line(algorithm: str, effective: dict[str, Any]) -> str | None:
    """One line naming the settings of this run that differ from ``algorithm``'s authors', or None."""
    diffs = differences(algorithm, effective)
    if not diffs:
        return None
    items = ", ".join(f"{s.key.split('.')[-1]} {_show(used)} (theirs {_show(s.value)})" for s, used in diffs)
    if effective.get("preset") == "authors":
        return f"note: {algorithm} runs its authors' settings ({AUTHORS[algorithm].code}) except {items}, as set"
    return (f"note: {algorithm} runs with fedlt's settings, not its authors' ({AUTHORS[algorithm].code}): {items}; "
            f"--preset authors runs theirs")


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return float(a) == float(b)
    return a == b


def _show(value: Any) -> str:
    return "none" if value is None else str(value).lower() if isinstance(value, bool) else f"{value:g}" \
        if isinstance(value, float) else str(value)


# -- the declarations -----------------------------------------------------------------------------
# Read at the commits below; "no X" lines point at the optimiser or loop that has none.

FEDGRAB = "github.com/ZackZikaiXiao/FedGraB@7394da67dc313ee2dddf82bf19ba100778709100"
declare("fedgrab", FEDGRAB, {
    "optimiser.lr": (0.03, "options.py:11"),
    "optimiser.momentum": (0.5, "options.py:12"),
    "optimiser.weight_decay": (0.0, "util/update_baseline.py:98"),  # SGD(lr, momentum) only
    "optimiser.clip": (None, "util/update_baseline.py:119"),  # backward, then step: no clipping
    "local_epochs": (5, "options.py:7"),
    "batch_size": (5, "README.md:24"),  # both usage commands; options.py:10's default is 10
    "drop_last": (False, "util/update_baseline.py:49"),
}, note="their loop steps the backbone only (util/update_baseline.py:98): the classifier stays as received "
        "(docs/replay.md)")

FEDVLS = "github.com/krumpguo/FedVLS@7d8163f4410ecef565a1d4e27703cd4bcab403d5"
declare("fedvls", FEDVLS, {
    "optimiser.lr": (0.01, "README.md:51"),
    "optimiser.momentum": (0.9, "system/flcore/clients/clientvls.py:41"),
    "optimiser.weight_decay": (0.0, "system/flcore/clients/clientvls.py:23"),  # forced, whatever -ed says
    "optimiser.clip": (None, "system/flcore/clients/clientvls.py:41"),
    "local_epochs": (10, "README.md:51"),
    "batch_size": (64, "system/data/generate_mnist.py:127"),
    "drop_last": (True, "system/data/generate_mnist.py:127"),
})

FEDETF = "github.com/ZexiLee/ICCV-2023-FedETF@092ace3471d0489c432fcde811ed7b7081042720"
declare("fedetf", FEDETF, {
    "optimiser.lr": (0.04, "args.py:54"),
    "optimiser.momentum": (0.9, "args.py:58"),
    "optimiser.weight_decay": (5e-4, "args.py:56"),
    "optimiser.clip": (None, "utils.py:267"),
    "local_epochs": (3, "args.py:24"),
    "batch_size": (128, "args.py:10"),
    "drop_last": (False, "nodes.py:112"),
})

FEDLOGE = "github.com/ZackZikaiXiao/FedLoGe@f4cac5260b73236b1ec0afd855e7d0a6ccbeebbc"
declare("fedloge", FEDLOGE, {
    "optimiser.lr": (0.03, "options.py:16"),
    "optimiser.momentum": (0.5, "options.py:17"),
    "optimiser.weight_decay": (0.0, "util/update_baseline.py:337"),
    "optimiser.clip": (None, "util/update_baseline.py:337"),
    "local_epochs": (5, "options.py:11"),
    "batch_size": (8, "options.py:15"),
    "drop_last": (False, "util/update_baseline.py:50"),
})

FEDNPC = "github.com/JintongGao/FedNPC@48ad8d1d253bed81c47c8650aae8b454437a138b"
declare("fednpc", FEDNPC, {
    "optimiser.lr": (0.1, "FedAvg-FedNPC.py:31"),
    "optimiser.momentum": (0.0, "FedAvg-FedNPC.py:112"),
    "optimiser.weight_decay": (0.0, "FedAvg-FedNPC.py:112"),
    "optimiser.clip": (None, "FedAvg-FedNPC.py:136"),
    "local_epochs": (10, "FedAvg-FedNPC.py:28"),
    "batch_size": (32, "FedAvg-FedNPC.py:29"),
    "drop_last": (False, "FedAvg-FedNPC.py:125"),
})

CREFF = "github.com/shangxinyi/CReFF-FL@fbec98f1a49dfb8d9f346d98bf3f9568d9004687"
declare("creff", CREFF, {
    "optimiser.lr": (0.1, "options.py:24"),
    "optimiser.momentum": (0.0, "main.py:173"),
    "optimiser.weight_decay": (0.0, "main.py:173"),
    "optimiser.clip": (None, "main.py:250"),
    "local_epochs": (10, "options.py:15"),
    "batch_size": (32, "options.py:16"),
    "drop_last": (False, "main.py:241"),
})

FEDNH = "github.com/Yutong-Dai/FedNH@60c3161412d576cddc8187af318cdc8a91a8709f"
declare("fednh", FEDNH, {  # experiments/FedNH_dir.sh:1 is their CIFAR-10 command (beta 0.3)
    "optimiser.lr": (0.01, "experiments/FedNH_dir.sh:1"),
    "optimiser.momentum": (0.9, "experiments/FedNH_dir.sh:1"),
    "optimiser.weight_decay": (1e-5, "experiments/FedNH_dir.sh:1"),
    "optimiser.clip": (10.0, "src/flbase/strategies/FedUH.py:107"),
    "local_epochs": (5, "experiments/FedNH_dir.sh:1"),
    "batch_size": (64, "experiments/Cifar10_Conv2Cifar.yaml:60"),
    "drop_last": (False, "src/flbase/client.py:41"),
}, note="their client lr decays by 0.99 a round (--client_lr_scheduler diminishing, src/flbase/utils.py:21); "
        "fedlt keeps the lr constant")

FEDLF = "github.com/18sym/FedLF@99f98b37e787713f5463214a79d36dbafa7dfd16"
declare("fedlf", FEDLF, {
    "optimiser.lr": (0.1, "options.py:49"),
    "optimiser.momentum": (0.0, "algorithm/our.py:320"),
    "optimiser.weight_decay": (0.0, "algorithm/our.py:320"),
    "optimiser.clip": (None, "algorithm/our.py:471"),
    "local_epochs": (5, "options.py:36"),
    "batch_size": (32, "options.py:37"),
    "drop_last": (False, "algorithm/our.py:408"),
})

# CCVR's authors published no code: FL-bench's CCVR (its FedAvg client, its default settings)
FLBENCH = "github.com/KarhouTam/FL-bench@06e658bca5af6ce732e25bb7c0f8be321e14a85e"
declare("ccvr", FLBENCH, {
    "optimiser.lr": (0.01, "config/defaults.yaml:48"),
    "optimiser.momentum": (0.0, "config/defaults.yaml:51"),
    "optimiser.weight_decay": (0.0, "config/defaults.yaml:50"),
    "optimiser.clip": (None, "src/client/fedavg.py:220"),
    "local_epochs": (5, "config/defaults.yaml:81"),
    "batch_size": (32, "config/defaults.yaml:82"),
    "drop_last": (False, "src/client/fedavg.py:62"),
}, note="FL-bench's, not the authors' (CCVR's authors published no code)")

FEDIC = "github.com/shangxinyi/FEDIC@76a1d75e33f1b315b0ab99f1e603a206c37c5446"
declare("fedic", FEDIC, {
    "optimiser.lr": (0.1, "options.py:28"),
    "optimiser.momentum": (0.0, "main.py:283"),  # SGD(params, lr) only
    "optimiser.weight_decay": (0.0, "main.py:283"),
    "optimiser.clip": (None, "main.py:299"),  # backward, then step: no clipping
    "local_epochs": (10, "options.py:17"),
    "batch_size": (128, "options.py:18"),
    "drop_last": (False, "main.py:290"),
}, note="the server's sizes (100 proxy images a class, 3 × 100 Adam steps at lr 0.001, T = 2, λ = 0.5) are "
        "fedic's defaults already (docs/algorithms.md)")

# The personalised methods as PFLlib runs them (its main.py defaults and clientbase's plain SGD
# over loaders that drop the last partial batch); the method constants fedlt's defaults already
# take from the methods' own authors (docs/algorithms.md) are left as they are.
PFLLIB = "github.com/TsingZ0/PFLlib@d832e76f6a23b833038949ec1e4fdefe63a4d350"
_PFLLIB_TRAINING = {
    "optimiser.lr": (0.005, "system/main.py:400"),
    "optimiser.momentum": (0.0, "system/flcore/clients/clientbase.py:47"),
    "optimiser.weight_decay": (0.0, "system/flcore/clients/clientbase.py:47"),
    "optimiser.clip": (None, "system/flcore/clients/clientbase.py:47"),
    "local_epochs": (1, "system/main.py:407"),
    "batch_size": (10, "system/main.py:399"),
    "drop_last": (True, "system/flcore/clients/clientbase.py:59"),
}
for _name, _extra in {
    "fedper": {}, "lg_fedavg": {}, "fedrod": {}, "ditto": {}, "apfl": {},
    "fedrep": {"algorithm_params.head_epochs": (1, "system/main.py:467")},
    "fedbabu": {"algorithm_params.finetune_epochs": (10, "system/main.py:471")},
    "fedavg_ft": {"algorithm_params.finetune_epochs": (10, "system/main.py:471")},
}.items():
    declare(_name, PFLLIB, {**_PFLLIB_TRAINING, **_extra})

# The methods of issue 45; their method constants are fedlt's defaults already (docs/algorithms.md).
FEDPROTO = "github.com/yuetan031/FedProto@97e42e2741e1ae2e2fce2465e80f38f6997f8836"
declare("fedproto", FEDPROTO, {
    "optimiser.lr": (0.01, "lib/options.py:22"),
    "optimiser.momentum": (0.5, "lib/update.py:145"),  # hard-coded, whatever --momentum says
    "optimiser.weight_decay": (0.0, "lib/update.py:144"),
    "optimiser.clip": (None, "lib/update.py:175"),
    "local_epochs": (1, "lib/options.py:18"),
    "batch_size": (4, "lib/options.py:20"),
    "drop_last": (True, "lib/update.py:42"),
})

FEDGELA = "github.com/MediaBrain-SJTU/FedGELA@b5b20d522c70672b9c374116797c20b0e3c7c806"
declare("fedgela", FEDGELA, {
    "optimiser.lr": (0.01, "FedGELA.py:169"),
    "optimiser.momentum": (0.9, "FedGELA.py:186"),
    "optimiser.weight_decay": (1e-4, "FedGELA.py:170"),  # --reg, passed to SGD at FedGELA.py:187
    "optimiser.clip": (20.0, "FedGELA.py:212"),  # clip_grad_norm_(max_norm=20): the total norm
    "local_epochs": (10, "FedGELA.py:168"),
    "batch_size": (64, "FedGELA.py:157"),
    "drop_last": (True, "load_data.py:173"),
})

FEDRELA = "github.com/guangzhengh/FedReLa@20a58bd75f48b3243f80adb35537b5b4ba252773"
declare("fedrela", FEDRELA, {
    "optimiser.lr": (0.001, "README.md:47"),  # every command of the README; options.py:68's default is 0.03
    "optimiser.momentum": (0.5, "options.py:69"),  # args_parser_cifar10, the README's CIFAR-10 suite
    "optimiser.weight_decay": (0.0, "util/update_baseline.py:369"),
    "optimiser.clip": (None, "util/update_baseline.py:484"),
    "local_epochs": (5, "README.md:47"),
    "batch_size": (8, "options.py:67"),
    "drop_last": (False, "util/update_baseline.py:53"),
}, note="from relabel_start on, their loop trains at lr x 0.1 (util/update_baseline.py:366-367): "
        "fedrela's lr_scale")

FEDYOYO = "github.com/shanss132/FedYoYo@342686e95f616e0b9bec9478dd324b73941f0895"
declare("fedyoyo", FEDYOYO, {
    "optimiser.lr": (0.1, "main_fedyoyo.py:59"),
    "optimiser.momentum": (0.0, "main_fedyoyo.py:154"),  # SGD(params, lr) only
    "optimiser.weight_decay": (0.0, "main_fedyoyo.py:154"),
    "optimiser.clip": (None, "main_fedyoyo.py:192"),
    "local_epochs": (10, "main_fedyoyo.py:56"),
    "batch_size": (32, "main_fedyoyo.py:57"),
    "drop_last": (False, "main_fedyoyo.py:163"),
})

# -- the classic and stateful baselines (issue 41: every algorithm whose authors published settings) --

FEDPROX = "github.com/litian96/FedProx@d2a4501f319f1594b732d88315c5ca1a72855f50"
declare("fedprox", FEDPROX, {
    "optimiser.lr": (0.01, "run_fedprox.sh:3"),
    "optimiser.momentum": (0.0, "flearn/optimizer/pgd.py:34"),  # var -= lr·(grad + mu·(var − vstar)), nothing else
    "optimiser.weight_decay": (0.0, "flearn/optimizer/pgd.py:34"),
    "optimiser.clip": (None, "flearn/optimizer/pgd.py:34"),
    "local_epochs": (20, "run_fedprox.sh:5"),
    "batch_size": (10, "run_fedprox.sh:4"),
    "drop_last": (False, "flearn/utils/model_utils.py:21"),
}, note="mu is not set: their README says to tune it per data set, no value works for all (README.md:17; its "
        "commands use 1, README.md:59); fedlt's stays 0.01 (--loss 'ce + fedprox(mu=1)' sets theirs). Their "
        "epochs reshuffle with the same seed, 100, every time (flearn/utils/model_utils.py:14)")

FEDDYN = "github.com/alpemreacar/FedDyn@48a19fac440ef079ce563da8e0c2896f8256fef9"
declare("feddyn", FEDDYN, {  # example_cifar_10.py is their CIFAR-10 script
    "optimiser.lr": (0.1, "example_cifar_10.py:45"),
    "optimiser.momentum": (0.0, "utils_general.py:190"),  # SGD(params, lr, weight_decay) only
    "optimiser.weight_decay": (1e-3, "example_cifar_10.py:40"),
    "optimiser.clip": (10.0, "utils_general.py:8"),  # max_norm, the total norm (clip_grad_norm_, :224)
    "local_epochs": (5, "example_cifar_10.py:44"),
    "batch_size": (50, "example_cifar_10.py:41"),
    "drop_last": (False, "utils_general.py:199"),  # ceil(n / batch) steps an epoch
    "algorithm_params.alpha": (0.01, "example_cifar_10.py:65"),
}, note="their α is divided by each client's share of the data relative to the mean (utils_methods.py:387, "
        "weights of mean 1 at :297); fedlt's α is the same for every client")

FEDNOVA = "github.com/JYWa/FedNova@47b4e096dfb19dc43c728896fff335a5befb645d"
declare("fednova", FEDNOVA, {  # launch_exp.sh:14 is their FedNova command (VGG, CIFAR-10)
    "optimiser.lr": (0.02, "launch_exp.sh:14"),
    "optimiser.momentum": (0.9, "launch_exp.sh:14"),
    "optimiser.weight_decay": (1e-4, "train_LocalSGD.py:179"),  # hard-coded
    "optimiser.clip": (None, "train_LocalSGD.py:256"),  # backward, then step: no clipping
    "local_epochs": (2, "launch_exp.sh:14"),
    "batch_size": (32, "launch_exp.sh:14"),
    "drop_last": (False, "util_v4.py:184"),
}, note="their lr drops ×0.1 at half the rounds and ×0.01 at three quarters (train_LocalSGD.py:300-310); "
        "fedlt keeps it constant")

FEDEXP = "github.com/Divyansh03/FedExP@34b05a269e2cff24c54c0b159bde80fa915bbeff"
declare("fedexp", FEDEXP, {  # their CIFAR-10 values (main.py:100-124)
    "optimiser.lr": (0.01, "main.py:102"),
    "optimiser.momentum": (0.0, "util_general.py:40"),
    "optimiser.weight_decay": (1e-4, "main.py:98"),
    "optimiser.clip": (10.0, "main.py:96"),  # use_gradient_clipping (main.py:97): the total norm (util_general.py:59)
    "local_iters": (20, "main.py:77"),  # "cp": 20 local steps, whatever the client's size
}, note="their 20 steps take batches of 50 (main.py:76), fedlt's iteration steps B_k ∝ |D_k| of --server-batch; "
        "their lr decays ×0.998 a round and ε ×0.998² (main.py:307-308), fedlt keeps both (ε 1e-3 is theirs, "
        "main.py:121); they report the mean of the last two iterates (main.py:419)")

MOON = "github.com/QinbinLi/MOON@8fcba3c4efc9a47eb24687a91ba94cfb2005103f"
declare("moon", MOON, {  # README.md:41-52 is their CIFAR-10 command
    "optimiser.lr": (0.01, "README.md:44"),
    "optimiser.momentum": (0.9, "main.py:268"),  # hard-coded
    "optimiser.weight_decay": (1e-5, "main.py:34"),  # --reg
    "optimiser.clip": (None, "main.py:318"),  # backward, then step: no clipping
    "local_epochs": (10, "README.md:46"),
    "batch_size": (64, "main.py:24"),
    "drop_last": (True, "utils.py:347"),
    "algorithm_params.mu": (5.0, "README.md:45"),  # main.py:42's default is 1
    "algorithm_params.temperature": (0.5, "main.py:44"),
}, note="their projection head (out_dim 256, main.py:43) between encoder and classifier is not added "
        "(docs/algorithms.md)")

FEDDECORR = "github.com/bytedance/FedDecorr@973e4af2d416e8dacda1fb19a328e440f9e815af"
_DECORR_RUN = "run_scripts/cifar10_fedavg_feddecorr.sh"
declare("feddecorr", FEDDECORR, {
    "optimiser.lr": (0.01, f"{_DECORR_RUN}:13"),
    "optimiser.momentum": (0.9, "main.py:73"),  # --rho
    "optimiser.weight_decay": (1e-5, f"{_DECORR_RUN}:5"),
    "optimiser.clip": (None, "approach/fedavg.py:153"),  # backward, then step: no clipping
    "local_epochs": (10, f"{_DECORR_RUN}:15"),
    "batch_size": (64, "main.py:69"),
    "drop_last": (False, "dataset_utils.py:136"),
    "algorithm_params.beta": (0.1, f"{_DECORR_RUN}:7"),
})

# Qu et al.'s FedSAM (ICML 2022, the paper fedsam's docstring cites) published no code: Caldarola et
# al.'s FedSAM (ECCV 2022), the same local SAM step, with its CIFAR-10 command.
FEDSAM = "github.com/debcaldarola/fedsam@64bbf9305a0bcf73138175018307254241c6ff42"
declare("fedsam", FEDSAM, {
    "optimiser.lr": (0.01, "paper_experiments/cifar10.sh:22"),
    "optimiser.momentum": (0.0, "models/utils/args.py:94"),  # -momentum's default; the command sets none
    "optimiser.weight_decay": (4e-4, "paper_experiments/cifar10.sh:22"),
    "optimiser.clip": (None, "models/clients/minimizers.py:46"),  # descent_step: optimizer.step, no clipping
    "local_epochs": (1, "paper_experiments/cifar10.sh:22"),
    "batch_size": (64, "paper_experiments/cifar10.sh:22"),
    "drop_last": (False, "models/clients/client.py:22"),
    "algorithm_params.rho": (0.1, "paper_experiments/cifar10.sh:22"),
}, note="Caldarola et al.'s FedSAM (ECCV 2022): Qu et al. (ICML 2022), whom fedsam cites, published no code")

# -- from the papers alone: the authors published no code. A source is "paper: <paper>:<where>".

SCALA_PAPER = "paper: Yang, Liu, SCALA"
_SCALA_SETTINGS = {
    "optimiser.lr": (0.01, "§5.1 Implementation details"),
    "server_batch": (320, "§5.1 Implementation details"),
    "local_iters": (5, "§5.1 Implementation details"),
}
declare("scala", SCALA_PAPER, _SCALA_SETTINGS, fedlt_defaults=True, note="fedlt's defaults; the paper states "
        "no momentum, weight decay or clip: fedlt's (0.9, 5e-4, 10) come from the authors' code as SPEC §3 records "
        "it, which is not public")
declare("fedlogit", SCALA_PAPER, _SCALA_SETTINGS, fedlt_defaults=True, note="fedlt's defaults; FedLogit is SCALA's "
        "baseline (§5.1 Baselines: FL with the client loss of eq. 15), run with the paper's settings")

FEDLC_PAPER = "paper: Zhang et al., FedLC, ICML 2022"
declare("fedlc", FEDLC_PAPER, {
    "optimiser.lr": (0.01, "§5.2"),
    "optimiser.momentum": (0.0, "App. A, Algorithm 1"),  # w ← w − η∇L
    "optimiser.weight_decay": (0.0, "§5.2"),  # "without weight decay"
    "optimiser.clip": (None, "App. A, Algorithm 1"),
    "batch_size": (128, "§5.2"),
}, note="the paper states neither its local epochs (Table 5 varies E over 1, 5, 10, 20; the batch of 128 "
        "applies once --local-epochs is given) nor τ")

SCAFFOLD_PAPER = "paper: Karimireddy et al., SCAFFOLD, ICML 2020"
declare("scaffold", SCAFFOLD_PAPER, {
    "optimiser.momentum": (0.0, "Algorithm 1"),  # y_i ← y_i − η_l(g_i(y_i) − c_i + c), nothing else
    "optimiser.weight_decay": (0.0, "Algorithm 1"),
    "optimiser.clip": (None, "Algorithm 1"),
}, note="its experiments tune the local lr for each method and take batches of a fifth of the client's "
        "data (5 steps an epoch): no lr or batch to take")

# -- none: nothing published that fedlt's run settings can express ---------------------------------

SPLITFED = "github.com/chandra2thapa/SplitFed-When-Federated-Learning-Meets-Split-Learning@45900d8faac8367dfaf409d2fede0f8a7fcc6040"
WHY_NONE.update({
    "fedavg": "McMahan et al. published no code, and the paper sweeps the lr, batch and epochs (no one setting)",
    "local": "no published method: each client trains alone",
    "splitfed_v1": f"its authors' code trains with Adam ({SPLITFED}:SFLV1_ResNet_HAM10000.py:266), and fedlt's run "
                   "optimiser is SGD",
    "splitfed_v2": f"its authors' code trains with Adam ({SPLITFED}:SFLV2_ResNet_HAM10000.py:256), and fedlt's run "
                   "optimiser is SGD",
    "splitfed_v3": "its authors published no code",
    "sfl_localloss": "its authors published no code",
})
