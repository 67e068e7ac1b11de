"""The decision package: settings, host facts, the model's shape, the plan, the layer split and the EngineSpec.

Its way in is glm53.planning.inputs (`inputs`, `make_plan`, `current_plan`): settings and the host's facts go in,
a Plan with its EngineSpec comes out. Everything here but inputs (the edge: host facts, checkpoint headers, saved
routing statistics) is pure, and nothing here imports the tiers, the engine or the server.
"""
