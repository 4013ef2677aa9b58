"""An example third-party fedlt plugin: a loss term (``poly1``), a partitioner (``zipf``), a model
(``tiny_cnn``), two algorithms (``example_fedcm``, ``example_feddc``), an aggregator (``lookahead``)
and a split server side (``grouped``), each declared as an entry point in ``pyproject.toml`` and
built on ``fedlt.plugin`` only. fedlt never imports this package by name; installing it is all it
takes."""
