"""The decision package: settings, host facts, the model's shape, the plan, the layer split and the EngineSpec.

Its way in is glm53.planning.inputs (`inputs`, `make_plan`, `current_plan`): settings and the host's facts go in,
a Plan with its EngineSpec comes out. Everything here but inputs is pure and imports nothing of the engine or the
server; inputs, the edge, reads the saved routing statistics through glm53.tiers.policy.
"""
