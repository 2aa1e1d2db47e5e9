"""Flow-level transmission: concurrent flows share links max-min fairly.

Flows start together; each crosses the directed links of its path and, while active,
moves at its max-min fair rate: progressive filling raises every unfrozen flow's rate
together until some link is full, freezes the flows on that link at its fair share
(remaining capacity / flows still unfrozen on it), and repeats. Whenever a flow
finishes, the rates of the rest are recomputed (event-driven), so a flow speeds up
when a flow it shared a link with is done. Cost per event: O(path entries x bottleneck
levels), vectorised with numpy; flows alone on all their links skip the events (rate =
their path's smallest capacity).

Inputs are CSR: flow f crosses ``entry_link[ptr[f]:ptr[f+1]]`` (local link indices
0..L-1 with capacities ``capacity[L]``), carrying ``nbytes[f]`` bytes.
"""

from __future__ import annotations

import numpy as np

__all__ = ["max_min_rates", "transmit"]

# Relative slack when comparing fair shares and finish times: values equal up to float
# rounding must count as ties, or a step of identical flows would take many events.
_TIE = 1e-9


def max_min_rates(entry_flow: np.ndarray, entry_link: np.ndarray, active: np.ndarray,
                  capacity: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Max-min fair rates of the ``active`` flows (progressive filling).

    Returns (rate per flow, the local link that froze it), 0 and -1 for inactive flows.
    Each round freezes every flow crossing a link whose fair share is the smallest, so
    the rounds are at most the number of distinct bottleneck levels.
    """
    num_flows, num_links = active.shape[0], capacity.shape[0]
    rates = np.zeros(num_flows)
    bottleneck = np.full(num_flows, -1, dtype=np.int64)
    remaining = capacity.astype(np.float64).copy()
    live = active.copy()
    while live.any():
        live_entry = live[entry_flow]
        counts = np.bincount(entry_link[live_entry], minlength=num_links)
        used = counts > 0
        share = np.full(num_links, np.inf)
        share[used] = remaining[used] / counts[used]
        level = share.min()
        tight = share <= level * (1 + _TIE)
        hit = np.flatnonzero(live_entry & tight[entry_link])
        flows, first = np.unique(entry_flow[hit], return_index=True)
        rates[flows] = level
        bottleneck[flows] = entry_link[hit[first]]
        frozen = np.zeros(num_flows, dtype=bool)
        frozen[flows] = True
        remaining -= np.bincount(entry_link[frozen[entry_flow]], minlength=num_links) * level
        np.maximum(remaining, 0.0, out=remaining)
        live &= ~frozen
    return rates, bottleneck


def transmit(ptr: np.ndarray, entry_link: np.ndarray, nbytes: np.ndarray,
             capacity: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """When each flow has pushed its last byte (s after the start) and the local link that
    limited it longest (the one that froze it in the period it moved the most bytes).

    Flows alone on every link of their path finish at nbytes / (their smallest capacity);
    the others run an event loop: rates by max-min, advance to the next finish, repeat.
    """
    num_flows = nbytes.shape[0]
    lengths = np.diff(ptr)
    entry_flow = np.repeat(np.arange(num_flows), lengths)
    entry_capacity = capacity[entry_link]
    # bottleneck of a lone flow: the first smallest-capacity link of its path
    path_min = np.minimum.reduceat(entry_capacity, ptr[:-1])
    candidate = np.where(entry_capacity == path_min[entry_flow], np.arange(entry_link.shape[0]), entry_link.shape[0])
    bottleneck = entry_link[np.minimum.reduceat(candidate, ptr[:-1])]
    finish = nbytes / path_min

    counts = np.bincount(entry_link, minlength=capacity.shape[0])
    shared = np.bincount(entry_flow, weights=counts[entry_link] > 1, minlength=num_flows) > 0
    active = shared & (nbytes > 0)
    if not active.any():
        return finish, bottleneck
    remaining = nbytes.astype(np.float64).copy()
    best_moved = np.zeros(num_flows)
    now = 0.0
    while active.any():
        rates, frozen_by = max_min_rates(entry_flow, entry_link, active, capacity)
        index = np.flatnonzero(active)
        to_finish = remaining[index] / rates[index]
        dt = to_finish.min()
        moved = rates[index] * dt
        longer = moved > best_moved[index]
        best_moved[index[longer]] = moved[longer]
        bottleneck[index[longer]] = frozen_by[index[longer]]
        remaining[index] -= moved
        now += dt
        done = index[to_finish <= dt * (1 + _TIE)]
        finish[done] = now
        remaining[done] = 0.0
        active[done] = False
    return finish, bottleneck
