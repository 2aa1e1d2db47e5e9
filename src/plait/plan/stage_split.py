"""Where the estimate cuts a model into pipeline chunks: the min-max split of the layer
groups (or the proportional one, whichever paces an interleaved pipeline better), Alpa's
DP for uneven models with the boundary receives priced, and whether a pipeline
crosses nodes. Groups are ``plait.plan.estimate.GroupCosts`` (their ``time_s`` and
``output_bytes``)."""

from __future__ import annotations

from plait.names.axes import PP
from plait.plan.cluster import Cluster
from plait.plan.layout import Layout
from plait.plan.stages import alpa_partition, minmax_partition

__all__ = ["split_groups", "pipeline_crosses_node", "alpa_split"]


def split_groups(summaries: list, chunks: int, ranks: int | None = None) -> list[list[int]]:
    """pp·v contiguous chunks of the groups minimising the slowest chunk's time. With
    v > 1 chunks per rank (chunk c on rank c mod ``ranks``) the ranks' totals pace the
    pipeline, so of the min-max split and the proportional split (boundaries where the
    running time crosses k/(pp·v) of the total) the one with the smaller largest
    per-rank total is taken."""
    times = [g.time_s for g in summaries]
    bounds = minmax_partition(times, chunks)
    if ranks is not None and ranks < chunks:
        total, prefix = sum(times), [0.0]
        for t in times:
            prefix.append(prefix[-1] + t)
        proportional = [0]
        for k in range(1, chunks):
            target = total * k / chunks
            nearest = min(range(proportional[-1] + 1, len(times) - (chunks - k) + 1),
                          key=lambda b: (abs(prefix[b] - target), b))
            proportional.append(nearest)
        proportional.append(len(times))

        def worst_rank(b):
            sums = [0.0] * ranks
            for c in range(chunks):
                sums[c % ranks] += prefix[b[c + 1]] - prefix[b[c]]
            return max(sums)

        if worst_rank(proportional) < worst_rank(bounds):
            bounds = proportional
    return [list(range(bounds[c], bounds[c + 1])) for c in range(chunks)]


def pipeline_crosses_node(layout: Layout, cluster: Cluster) -> bool:
    """Whether some pair of pipeline neighbours (``layout.stride("pp")`` ranks apart)
    sits on different nodes; the slowest boundary paces the pipeline. With pp
    outermost (the default order) a pipeline spans every rank, so on more than one
    node some boundary always crosses."""
    return cluster.nodes > 1 and layout.pp > 1 and cluster.group_shape(layout.pp, layout.stride(PP)).nodes > 1


def alpa_split(summaries: list, layout: Layout, cluster: Cluster) -> list[list[int]]:
    """Stages for an uneven model by Alpa's DP (``plait.plan.stages.alpa_partition``),
    one pipeline rank each: minimise Σ t_s + (m-1)·max t_s with t_s the slice's time
    plus its boundary receives, the estimate's own 1F1B/GPipe formula."""
    crosses = pipeline_crosses_node(layout, cluster)
    prefix = [0.0]
    for group in summaries:
        prefix.append(prefix[-1] + group.time_s)
    count = len(summaries)

    def stage_time_s(i: int, j: int, n: int) -> float:
        receive = cluster.p2p_time_s(summaries[i - 1].output_bytes, crosses) if i > 0 else 0.0
        send_back = cluster.p2p_time_s(summaries[j - 1].output_bytes, crosses) if j < count else 0.0
        return prefix[j] - prefix[i] + receive + send_back

    stage_plan = alpa_partition(count, layout.pp, (1,), layout.num_microbatches, stage_time_s)
    return [list(range(i, j)) for i, j in stage_plan.slices]
