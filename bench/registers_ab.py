"""Whole-model decode with the MXFP4 down kernel's register cap on and off, in one process each way:
    python bench/registers_ab.py on|off -- <localchat bench arguments>
"off" sets kernels.moe_config.MXFP4_DOWN_REGISTERS to 0 (the compiler's choice) before the bench."""
import sys

import localchat.kernels.moe_config as moe_config
from localchat.app.cli import main

mode, _, args = sys.argv[1], sys.argv[2], sys.argv[3:]
if mode == "off":
    moe_config.MXFP4_DOWN_REGISTERS = 0
print(f"MXFP4_DOWN_REGISTERS = {moe_config.MXFP4_DOWN_REGISTERS}", flush=True)
sys.exit(main(["bench", *args]))
