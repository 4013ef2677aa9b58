"""fedlt: federated learning under label skew and long-tailed data, including split FL."""

__version__ = "0.1.0"
