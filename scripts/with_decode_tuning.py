"""Run an ostinato command with other decode-attention defaults (kernels/decode_plan.py, DecodeTuning), for
measurements whose process cannot reach the tuning otherwise (`bench throughput` builds its own engine):

    PYTHONPATH=src python3 scripts/with_decode_tuning.py num_warps=4 -- bench throughput CK --max-model-len 4096
"""

from __future__ import annotations

import functools
import sys

from ostinato import cli
from ostinato.kernels import decode_plan


def main() -> int:
    split = sys.argv.index("--")
    fields = dict(item.split("=") for item in sys.argv[1:split])
    tuning = functools.partial(decode_plan.DecodeTuning, **{k: int(v) for k, v in fields.items()})
    decode_plan.DecodeTuning = tuning  # the runner imports it from the module when it builds the backend
    print(f"decode tuning: {tuning()}", flush=True)
    return cli.main(sys.argv[split + 1:])


if __name__ == "__main__":
    sys.exit(main())
