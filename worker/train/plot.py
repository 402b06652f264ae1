"""`ps-worker --plot`: loss and held-out accuracy over time, as a PNG (matplotlib is an optional extra)."""

from __future__ import annotations

from paramserver.files import atomic_write


def plot_history(history: dict[str, list[float]], path: str, title: str = "") -> None:
    """Draw the training loss per step and the test accuracy (a regression: the test loss) per epoch against wall time
    into `path`."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("--plot needs matplotlib: pip install 'paramserver[plot]'") from exc

    fig, loss_ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    loss_ax.plot(history["time"], history["loss"], color="tab:blue", linewidth=0.8, alpha=0.8, label="loss")
    loss_ax.set_xlabel("seconds")
    loss_ax.set_ylabel("training loss (per step)", color="tab:blue")
    loss_ax.set_yscale("log")
    acc_ax = loss_ax.twinx()
    if history["accuracy"] or not history.get("test_loss"):
        acc_ax.plot(history["eval_time"], history["accuracy"], color="tab:orange", marker="o", label="test accuracy")
        acc_ax.set_ylabel("held-out accuracy (per epoch)", color="tab:orange")
        acc_ax.set_ylim(0, 1)
    else:  # a regression: no accuracy, its mean test loss instead
        acc_ax.plot(history["eval_time"], history["test_loss"], color="tab:orange", marker="o", label="test loss")
        acc_ax.set_ylabel("held-out loss (per epoch)", color="tab:orange")
        acc_ax.set_yscale("log")
    if title:
        loss_ax.set_title(title)
    fig.tight_layout()
    try:
        atomic_write(path, lambda f: fig.savefig(f, format="png"))
    finally:
        plt.close(fig)
