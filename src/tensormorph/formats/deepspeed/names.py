"""The names the ZeRO reader gives things, shared by the ZeRO and universal readers so the two compare directly."""

NAME = "deepspeed"

OPTIMIZER_PREFIX = "optimizer."
MODULE_PREFIX = "module."
STATE_PREFIX = "optimizer.state."
