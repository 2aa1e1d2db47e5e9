"""A rank for tests of plait.train.agent: joins the world, then fails as argv says.

    python agent_worker.py same     # every rank raises the same ValueError
    python agent_worker.py one      # rank 1 raises a ValueError; the others wait for it and die
    python agent_worker.py bug      # rank 0 hits a bug (ZeroDivisionError): reported with its traceback
    python agent_worker.py ok       # every rank finishes
    python agent_worker.py diverged # every rank's LossScaler sees inf gradients: LossScaleError (a user error)
"""

import sys
import time

import torch
import torch.distributed as dist

from plait.memory.loss_scale import LossScaler
from plait.train.agent import record_rank_error


def main(mode: str) -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        if mode == "same":
            raise ValueError("every rank found the bad value 7: use 8")
        if mode == "one" and rank == 1:
            raise ValueError("rank one found the bad value 42: use 43")
        if mode == "bug" and rank == 0:
            print(1 / 0)
        if mode == "diverged":  # plait's own scaler, on the world, after one step of inf gradients
            weight = torch.nn.Parameter(torch.ones(3))
            weight.grad = torch.full((3,), float("inf"))
            scaler = LossScaler(max_consecutive_overflows=1)
            scaler.unscale([weight])
            assert scaler.found_overflow()
            scaler.update()  # raises LossScaleError
        if mode == "ok":
            dist.barrier()
            return 0
        time.sleep(60)  # the failing rank's peers: torchrun stops them
    except Exception as error:  # noqa: BLE001 -- recorded for the agent, which prints it once
        record_rank_error(error)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
