"""How a step spends its prefill budget (``plan_prefill``): which prompts go in, whole or a
chunk, together or alone. A part of the scheduler's decision (``Scheduler.schedule``). No MLX.
"""

from __future__ import annotations

import collections

from veloxquant_mlx.engine.loop.seq import Chunk, Seq, StepPlan


def plan_prefill(
    plan: StepPlan,
    running: list[Seq],
    prefill_budget: int,
    idle_prefill_budget: int,
    prefill_step: int,
) -> None:
    """Spend the prefill budget on the admitted rows not yet decoding, oldest first
    (``prefill_budget`` while some row decodes: the step pauses its stream; else
    ``idle_prefill_budget``): whole short prompts that have not started, together in one
    padded forward; the rest a chunk at a time, a prompt that one chunk holds only whole
    (a forward costs the host about the same whatever its width: a prompt the budget left
    cannot finish waits for the next step, where it goes in whole, rather than go in as
    two forwards). With several groups' prompts pending, a group of several spends at most
    an even share of the budget, so one client's many long prompts do not hold back
    another's."""
    pending = [s for s in running if not s.decoding]
    if not pending:
        return
    decoding = len(pending) < len(running)
    budget = prefill_budget if decoding else idle_prefill_budget
    step = prefill_step
    fresh: list[Seq] = []
    width = 0
    for seq in pending:
        n = len(seq.tokens)
        if seq.n_kv == 0 and n <= step:
            if max(width, n) * (len(fresh) + 1) > budget:
                break
            fresh.append(seq)
            width = max(width, n)
    if len(fresh) > 1:
        plan.together = fresh
        budget -= width * len(fresh)
        for seq in fresh:
            seq.n_kv, seq.decoding = len(seq.tokens), True
        pending = [s for s in pending if s not in fresh]
    spent = bool(plan.together)
    # Several groups' prompts pending: a group of several spends at most an even share of
    # the budget (a lone prompt is not split by it).
    count = collections.Counter(s.group for s in pending)
    cap = -(-budget // len(count)) if len(count) > 1 else budget
    by_group: collections.Counter[int] = collections.Counter()
    for seq in pending:
        if budget <= 0:
            break
        mine = cap if count[seq.group] > 1 else budget
        allowed = min(budget, mine - by_group[seq.group])
        if allowed <= 0:
            continue
        left = len(seq.tokens) - seq.n_kv
        if spent and left <= step and allowed < left:
            continue  # one chunk holds it: it goes in whole, next step
        chunk = Chunk(seq, seq.n_kv, min(left, max(1, min(allowed, step))))
        plan.chunks.append(chunk)
        seq.n_kv += chunk.n
        seq.decoding = chunk.completes
        budget -= chunk.n
        by_group[seq.group] += chunk.n
        spent = True
