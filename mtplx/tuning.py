"""`mtplx tune`: choose AR or an MTP depth from this machine's measured step costs.

The choice comes from the cost model (engine/step_costs.py): c(1) and c(k+1) (trunk forwards over
1 and k+1 tokens), the cost of one draft step, the engine's host time per step (from the AR
requests' statistics) and acceptance by depth from a depth-4 run give a predicted MTP/AR for every depth; the
best depth is kept if it beats AR (a deeper depth only when predicted more than 5% faster). Step costs are medians of
many interleaved forwards, which a noisy shared machine disturbs far less than whole decodes.
The decode speed of every arm is measured too (medians of interleaved rounds) and printed next to
the prediction; where an arm measured faster than the modelled pick in every round (and 5% faster
in the median round), it is chosen instead.
The result is stored per model identity (see settings.py).
"""

from __future__ import annotations

import statistics
from typing import Callable

from mtplx.catalog import resolve
from mtplx.engine import step_costs
from mtplx.engine.engine import Engine, EngineConfig
from mtplx.engine.request import GenerationRequest
from mtplx.engine.sampling import SamplingParams
from mtplx.settings import store_tuned

# One prompt per round, of different kinds: acceptance depends on what is being written (code,
# prose, an edit), and a depth tuned on one kind of text overfits it.
PROMPTS = [
    [{"role": "user", "content": "Read src/parser/events.py and explain what it does."}],
    [{"role": "user", "content": "In a few paragraphs, explain why a team writes unit tests and what makes one useful."}],
    [{"role": "user", "content": "Rename the function load_config to read_settings and update every caller."}],
]
ROUNDS = 4  # even: each arm decodes as often early in a round as late


def tune_model(model: str, tokens: int = 128, save: bool = True, echo: Callable[[str], None] = print) -> dict:
    path = resolve(model)
    engine = Engine(path, EngineConfig()).start()
    try:
        if not engine.has_mtp:
            echo(f"{model} has no MTP weights: autoregressive decoding is its only mode")
            return {"ar": None}
        prompts = [tuple(engine.checkpoint.tokenizer.apply_chat_template(p, add_generation_prompt=True)) for p in PROMPTS]
        deepest = step_costs.MAX_DEPTH
        arms = {"ar": (False, 1)} | {f"depth {d}": (True, d) for d in range(1, deepest + 1)}

        def run(mtp: bool, depth: int, ids: tuple[int, ...], n: int = tokens):
            request = GenerationRequest(ids, SamplingParams(max_tokens=n, ignore_eos=True), use_mtp=mtp, depth=depth,
                                        source="tune")
            return engine.submit(request).result().stats

        for mtp, depth in arms.values():  # warm-up: compiles every step shape
            run(mtp, depth, prompts[0], 16)
        speeds: dict[str, list[float]] = {name: [] for name in arms}
        costs, acceptance, hosts = [], [], []
        for r in range(ROUNDS):
            ids = prompts[r % len(prompts)]  # every arm decodes the same prompt in a round
            # Every other round in reverse: on a machine whose speed swings within a round, no arm
            # always decodes at the same point of it (one run chose depth 1 at 1.36x when it
            # always came right after AR, and served at 1.02x).
            order = list(arms.items()) if r % 2 == 0 else list(reversed(arms.items()))
            for name, (mtp, depth) in order:
                stats = run(mtp, depth, ids)
                speeds[name].append(stats.decode_tps or 0.0)
                if depth == deepest and mtp:
                    acceptance.append(stats.acceptance_by_depth)
                if not mtp:
                    hosts.append(step_costs.host_per_step(stats))
            costs.append(engine.call(lambda: step_costs.measure(engine.runner, list(ids))))
        model_costs = step_costs.median_of(costs).with_host(statistics.median(hosts))
        accepted = [statistics.median(a[i] or 0.0 for a in acceptance) for i in range(deepest)]
        return _choose(model_costs, accepted, speeds, engine.checkpoint.identity, save, echo)
    finally:
        engine.stop()


def _choose(costs: step_costs.StepCosts, acceptance: list[float], speeds: dict, identity: str, save: bool,
            echo: Callable[[str], None]) -> dict:
    measured = {name: statistics.median(v) for name, v in speeds.items()}
    c1 = costs.forward[1]
    echo(f"c(1) {c1 * 1000:.2f} ms, draft step {costs.draft * 1000:.2f} ms, host per step {costs.host * 1000:.2f} ms; "
         "acceptance by depth "
         + " ".join(f"{a:.2f}" for a in acceptance))
    echo(f"{'arm':<8} {'c(k+1)/c(1)':>11} {'round/c(1)':>10} {'predicted':>9} {'measured':>15}")
    echo(f"{'ar':<8} {1.0:11.2f} {1.0:10.2f} {1.0:9.2f} {measured['ar']:7.1f} tok/s (1.00x)")
    for k in range(1, len(acceptance) + 1):
        tps = measured[f"depth {k}"]
        echo(f"{'depth ' + str(k):<8} {costs.forward[k + 1] / c1:11.2f} {(costs.round_s(k) - costs.host) / c1:10.2f} "
             f"{costs.speedup(k, acceptance):9.2f} {tps:7.1f} tok/s ({tps / measured['ar']:.2f}x)")
    modelled = costs.best_depth(acceptance)
    depth = choose_depth(modelled, speeds)
    why = "by the cost model" if depth == modelled else \
        f"by the measured speeds (the cost model chose {'ar' if modelled is None else f'depth {modelled}'})"
    echo(f"chosen {why}: {'ar' if depth is None else f'depth {depth}'}"
         + (" (stored as this model's default)" if save else ""))
    if save:
        try:
            store_tuned(identity, depth is not None, depth or 1, measured
                        | {"predicted": {k: costs.speedup(k, acceptance) for k in range(1, len(acceptance) + 1)}})
        except OSError as exc:  # a full or read-only home: the measurements above still stand
            echo(f"could not store it as the default ({exc}); pass {'--no-mtp' if depth is None else f'--depth {depth}'}"
                 " instead")
    return measured | {"chosen": depth}


# The cost model's choice stands unless the interleaved decode measurements clearly disagree: a
# cost it does not model (a hybrid model's recurrent-state rollback after a rejected draft) showed
# as depth 1 measured 1.54x against depth 3's 1.10x, while all depths were predicted at 1.28-1.31x.
# "Clearly" is paired by round (every arm decodes a round's prompt back to back): the other arm
# must be faster in every round and by CLEARLY_FASTER in the median round. Comparing medians
# alone let one noisy round overturn the model (a hybrid run chose depth 2 at a measured 1.86x
# that served at 1.03x).
CLEARLY_FASTER = 1.05


def choose_depth(modelled: int | None, speeds: dict) -> int | None:
    """The depth to decode at (None: AR) from the cost model's pick and the measured tok/s per arm
    and round ("ar", "depth 1", ... -> [tok/s of round 1, round 2, ...]): the modelled pick unless
    another arm was faster in every round and CLEARLY_FASTER in the median one."""
    arms = {None: speeds["ar"]} | {int(name.split()[1]): v for name, v in speeds.items() if name.startswith("depth ")}
    base = arms.get(modelled)
    if not base:
        return max(arms, key=lambda k: statistics.median(arms[k]))

    def lead(k) -> float:  # the median per-round ratio over the modelled pick; 0 unless faster in every round
        ratios = [a / b if b else float("inf") for a, b in zip(arms[k], base)]
        return statistics.median(ratios) if ratios and min(ratios) > 1.0 else 0.0

    leads = {k: lead(k) for k in arms if k != modelled}
    best = max(leads, key=leads.get, default=modelled)
    return best if best != modelled and leads[best] > CLEARLY_FASTER else modelled
