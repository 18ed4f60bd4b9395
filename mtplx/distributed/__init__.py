"""One model over several ranks on MLX's own distributed arrays (`mlx.core.distributed`).

layout.py: the split a run uses and the combinations refused before loading (pure);
group.py: joining the ring and the collectives mtplx adds (a broadcast, a gather), each under
the watchdog (watchdog.py); shard.py: loading lazily, sharding with mlx-lm's own `shard()` /
`pipeline()`, then evaluating; lockstep.py: the engine every rank runs, fed rank 0's decisions;
agreement.py: the bank's restore point agreed across ranks; launch.py: N local ranks over loopback.
Never imports textual, typer or the HTTP framework.
"""
