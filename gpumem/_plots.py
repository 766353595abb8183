"""matplotlib for every chart (the demo, ``--plot``, reports): imported on first use only.

matplotlib is a default dependency (the demo draws its story), but the checkpoint half never
needs it and a ``--no-deps`` install leaves it out (README, "Install"); a chart asked for there
fails in one line that says what to install, not with an import traceback.
"""

from __future__ import annotations

from typing import Any


def pyplot() -> Any:
    """``matplotlib.pyplot``, on the Agg backend unless the caller chose one already."""
    try:
        import matplotlib
    except ModuleNotFoundError as exc:
        if exc.name != "matplotlib":
            raise
        raise ModuleNotFoundError(
            "charts need matplotlib, which is not installed: pip install matplotlib"
        ) from None
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt
