"""Where one training step's time went on one rank: ``StepTimes``, the timed parts
``plait.parallel.hybrid.train_step`` measures (timers around the real calls), which
add up to the step's wall time:

    wall = compute + tp_comm + pp_comm + receive + dp_comm + optimizer + data + other

``plait.train.step_breakdown`` sums them over steps and, with every rank's message and
closing post times, splits the pipeline waits into transfer and bubble.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass
class StepTimes:
    """Where one step's time went on this rank (seconds), in the parts of
    ``plait.names.step_parts``, each from a timer around the real calls:

    - ``compute_s``: the engine's forward/backward intervals minus the tensor-parallel
      collectives run inside them (plait.comm's time on the tp group meanwhile);
      ``stage_compute_s``: the same per pipeline stage (model chunk) this rank runs
      (each interval's share of the collectives in proportion to its length);
    - ``tp_comm_s``: tp-group collectives during the engine's step (synchronous calls);
    - ``pp_comm_s``: posting sends and waiting for them at the flush;
    - ``receive_s``: waiting in pipeline receives: the peer still computing (the bubble)
      and the message's transfer together (``plait.train.step_breakdown`` splits it
      with the senders' post times into pp_bubble and pp_comm);
    - ``dp_comm_s``: the engine's closing collectives (loss sum, shared and Chimera
      replica gradients), the dp sync (gradient averaging or ZeRO's reduce-scatter,
      unscale, the gradient-norm and loss reductions), the dp collectives inside
      the optimizer step (ZeRO's parameter all-gather) and ZeRO's waits inside the
      forwards and backwards (``zero_wait_s``: stage 3's parameter gathers made ready,
      stage 2/3's reduce-scatters waited for at the next backward's start; taken out of
      the engine's busy intervals, so not in ``compute_s``);
    - ``optimizer_s``: the optimizer step without those collectives;
    - ``data_s``: fetching the batch (the caller's timer: ``with_data``);
    - ``other_s``: wall - every part above (bookkeeping: the engine's own between its
      actions, zeroing gradients, the learning rate), so the parts add up to wall. It is
      >= 0 (float rounding clamped); a negative one is kept as measured: two timers
      overlapped (``plait.parallel.hybrid.remainder_s``).

    ``closing_s`` is not a part of its own: it is the share of ``dp_comm_s`` spent in the
    engine's closing collectives. With pp > 1 it holds the pipeline drain on every rank
    but the last to finish (they wait in the loss sum for the first stage's last
    backward); ``plait.train.step_breakdown`` moves that wait to pp_bubble with the
    pipeline ranks' post times of the loss sum.

    The coarse split of earlier reports is kept as properties: ``comm_s`` = tp + dp,
    ``bubble_s`` = pp_comm + receive waits, ``rest_s`` = optimizer + data + other."""

    wall_s: float = 0.0
    compute_s: float = 0.0
    tp_comm_s: float = 0.0
    pp_comm_s: float = 0.0
    receive_s: float = 0.0
    dp_comm_s: float = 0.0
    optimizer_s: float = 0.0
    data_s: float = 0.0
    other_s: float = 0.0
    stage_compute_s: dict = field(default_factory=dict)  # pipeline stage -> compute seconds
    closing_s: float = 0.0  # of dp_comm_s: the engine's closing collectives (not added to wall again)
    zero_wait_s: float = 0.0  # of dp_comm_s: ZeRO's waits inside forward/backward (not added to wall again)

    @property
    def comm_s(self) -> float:
        return self.tp_comm_s + self.dp_comm_s

    @property
    def bubble_s(self) -> float:
        return self.pp_comm_s + self.receive_s

    @property
    def rest_s(self) -> float:
        return self.optimizer_s + self.data_s + self.other_s

    def with_data(self, data_s: float) -> "StepTimes":
        """These times with ``data_s`` of batch fetching before the step (added to wall)."""
        return replace(self, data_s=self.data_s + data_s, wall_s=self.wall_s + data_s)

    def as_dict(self) -> dict:
        return {**{name: getattr(self, name) for name in TIMED_PARTS}, "closing_s": self.closing_s,
                "zero_wait_s": self.zero_wait_s,
                "stage_compute_s": {str(stage): value for stage, value in self.stage_compute_s.items()}}


# the StepTimes fields that add up to wall_s
TIMED_PARTS = ("wall_s", "compute_s", "tp_comm_s", "pp_comm_s", "receive_s", "dp_comm_s",
               "optimizer_s", "data_s", "other_s")
