"""Running an experiment: flags, the launcher, and the learner, actor and evaluator worker processes.

Import the submodules (`launch.launcher`, `launch.flags`, ...) directly; this
package imports nothing, so a worker can set its thread budget before JAX loads.
"""
