"""Time a config's training step: the same as `lwm bench` (see lwm/bench.py for what is measured and how).

    python benchmarks/train_step.py --config configs/base.yaml [--steps N (10)] [--warmup N (3)] [--json OUT.json]

It runs where wandb and diffusers are not installed (nothing here imports them).
"""

import sys

from lwm.cli.bench import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
