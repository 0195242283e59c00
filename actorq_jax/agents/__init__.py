"""Agents: one folder each (config, networks and losses, acting, builder), registered by name.

`registry` (no JAX) lists them; `builder.AgentBuilder` is the contract every
builder fulfils. See the README section "Adding an agent".
"""
