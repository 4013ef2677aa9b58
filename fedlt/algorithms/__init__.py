"""Federated algorithms, each a registered composition of the library's parts."""

from fedlt.registry import Registry

ALGORITHM_METHODS = ("setup", "train_round", "global_model", "state_dict", "load_state_dict")


def _algorithm_check(obj) -> str | None:
    missing = [m for m in ALGORITHM_METHODS if not callable(getattr(obj, m, None))]
    return f"{type(obj).__name__} lacks {', '.join(missing)} (see fedlt.algorithms.base.Algorithm)" if missing else None


REGISTRY: Registry = Registry("algorithm", product=_algorithm_check)
register, get, create, list = REGISTRY.register, REGISTRY.get, REGISTRY.create, REGISTRY.list


def preset(name: str, engine: type, doc: str, **defaults) -> None:
    """Register ``name`` as ``engine`` with these default parameters (the caller's override them)."""

    def factory(**params):
        return engine(**{**defaults, **params})

    factory.__doc__ = doc
    register(name)(factory)


def server_data_per_class(algorithm) -> tuple[int, str]:
    """How many training images of each class ``algorithm`` needs at the server, held out of the
    clients' data before partitioning (its ``server_data_per_class()``: 0 when it defines none),
    and the parameters that set it, for messages."""
    need = getattr(algorithm, "server_data_per_class", None)
    return need() if callable(need) else (0, "")


from fedlt.algorithms import fedavg_family, fedgela, fedic, fedproto, fedrela, fedyoyo, longtail, pfl, recalibrate, split, stateful  # noqa: E402,F401  (register the built-ins)
from fedlt.algorithms import personal  # noqa: E402,F401  (installs the runners' per-client evaluation)
