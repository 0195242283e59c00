"""The columns of a run's CSV streams, written once for the processes that write them and the code that reads them."""

# Phases an actor's time is split into (seconds per episode in actors/actor_<i>.csv). "adder" is the
# replay write itself; "rate_limit_wait" the time the server held the actor's items back (Reverb's
# rate limiter refusing inserts because the learner is behind): large means the learner bounds the run.
ACTOR_PHASES = ("env_step", "inference", "adder", "rate_limit_wait", "pull", "deserialize", "load")

# actors/actor_<i>.csv: one row per finished episode; (actor_id, incarnation, episode) is its identity
# (incarnation: a token of the actor process, so a row sent twice is written once); env_index is which of the actor's environments
# (--envs_per_actor) finished it, episode and env_steps count over all of them. rejected_payloads counts (cumulatively) the
# variable payloads the actor refused (malformed, non-finite, or not fitting its network). <phase>_s is a
# phase's wall time in the episode, <phase>_cpu_s the process's CPU time while it ran (all threads: XLA computes
# on its own; pull, deserialize and load run in the variable client's thread and count that thread's CPU): wall
# well above CPU means the process waited for a core (or, for adder and pull, for the server).
# policy_backend names what computed the actor's policy: "fp32", "fakequant" or "int8/<packing>/<kernel path>" (e.g.
# "int8/w8a8/amx"; the path the process resolved, so a run says whether its actors had the compiled kernel).
# summary.json's "cpu_clock" says which clock a run's CPU columns used ("process"; runs without it: the timing
# thread's alone, which misses the compute XLA runs on its own threads).
CPU_CLOCK = "process"
ACTOR_FIELDS = (
    "actor_id", "incarnation", "episode", "env_index", "env_steps", "episode_return", "episode_length", "wall_seconds",
    "params_version", "rejected_payloads", "policy_backend",
) + tuple(f"{phase}_s" for phase in ACTOR_PHASES) + tuple(f"{phase}_cpu_s" for phase in ACTOR_PHASES)

# eval.csv: one row per evaluation episode and policy ("fp32", or "actor": what actors run).
EVAL_FIELDS = ("wall_seconds", "env_steps", "learner_steps", "policy", "bits", "episode", "return", "final")
