"""Draw docs/img/gluon_timeline.png: the schedule of the Gluon forward (a schematic, not a trace).

    python docs/img/gluon_timeline.py

Rows: the producer warp, the two consumer warpgroups, and the tensor cores. Durations are in
units of one 64x128x128 wgmma (S or P V for one warpgroup); the softmax of a tile is drawn at
about that length, as it is on an H100 at D = 128.
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

GEMM, SOFT = 1.0, 1.0
COLORS = {"S": "#4C72B0", "PV": "#55A868", "softmax": "#C44E52", "TMA": "#8172B2", "wait": "#DDDDDD"}


def schedule(steps: int = 4):
    """(row, start, length, kind, label) bars of the ping-pong schedule, from a small simulation:
    the tensor cores run GEMMs in issue order; a consumer issues S_j and P_{j-1} V_{j-1} together
    (after the other consumer has issued, the ping-pong token), runs the softmax of S_j as soon as
    S_j is done, and may issue again once both its softmax and its P V are done."""
    bars = []
    tc_free = 0.0
    ready = [0.0, 0.0]
    last_issue = -1.0
    for j in range(steps + 1):
        for wg in (0, 1):
            issue = max(ready[wg], last_issue + 0.05)
            last_issue = issue
            s_end = issue
            if j < steps:
                s0 = max(issue, tc_free)
                s_end = tc_free = s0 + GEMM
                bars.append(("tensor cores", s0, GEMM, "S", f"S{j}·{wg}"))
            p_end = issue
            if j > 0:
                p0 = max(issue, tc_free)
                p_end = tc_free = p0 + GEMM
                bars.append(("tensor cores", p0, GEMM, "PV", f"PV{j - 1}·{wg}"))
            soft_end = s_end
            if j < steps:
                bars.append((f"consumer {wg}", s_end, SOFT, "softmax", f"softmax {j}"))
                soft_end = s_end + SOFT
            ready[wg] = max(soft_end, p_end)
    for j in range(steps + 1):
        bars.append(("producer", j * 2.0, 0.5, "TMA", f"K{j},V{j}"))
    return bars


def main():
    rows = ["producer", "consumer 0", "consumer 1", "tensor cores"]
    fig, ax = plt.subplots(figsize=(11, 3.2))
    for row, start, length, kind, label in schedule():
        y = rows.index(row)
        ax.barh(y, length, left=start, color=COLORS[kind], edgecolor="white", height=0.6)
        ax.text(start + length / 2, y, label, ha="center", va="center", fontsize=6.5, color="white")
    ax.set_yticks(range(len(rows)), rows)
    ax.invert_yaxis()
    ax.set_xlabel("time (units of one 64x128x128 wgmma); label S2·1 = S of key tile 2 for consumer 1")
    ax.set_title("Gluon forward on sm_90: producer warp, two ping-pong consumer warpgroups (schematic)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values() if c != COLORS["wait"]]
    ax.legend(handles, ["S = Q K^T", "O += P V", "softmax", "TMA K, V"], loc="upper right", fontsize=7, ncol=4)
    fig.tight_layout()
    fig.savefig(Path(__file__).with_suffix(".png"), dpi=130)


if __name__ == "__main__":
    main()
