"""Plot a head's held-out estimate against training tokens from `train_log.json` files.

    python benchmarks/training_curve.py OUT.png LABEL=HEAD_DIR [LABEL=HEAD_DIR ...]

Each curve is one training run's history (`specdecode train` scores the head every
--eval-every steps): top-1 agreement with the target at TTT step 0 and the implied tau.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(argv: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out, runs = Path(argv[0]), [a.rsplit("=", 1) for a in argv[1:]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for label, folder in runs:
        history = json.loads((Path(folder) / "train_log.json").read_text())["history"]
        tokens = [h["answer_tokens"] / 1000 for h in history]
        left.plot(tokens, [h["agree_0"] for h in history], marker="o", label=label)
        right.plot(tokens, [h["tau"] for h in history], marker="o", label=label)
    left.set(xlabel="answer tokens trained on (thousands)", ylabel="held-out top-1 agreement")
    right.set(xlabel="answer tokens trained on (thousands)", ylabel="held-out tau estimate")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1:])
