"""`localchat bench` from a checkout where the package is not installed (the GPU machine):
    python bench/bench_decode.py gpt-oss-20b,gpt-oss-120b,glm-4.5v-fp8 --dummy --gen-len 32
Same as `localchat bench`."""
import sys

from localchat.app.cli import main

sys.exit(main(["bench", *sys.argv[1:]]))
