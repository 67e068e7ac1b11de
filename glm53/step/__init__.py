"""The per-layer MoE step: which tier each of a layer's expert picks is read from, and the bookkeeping after it.

  stepper     MoeStepper: one decode step and one prefill step over the tiers, and what runs after launch
  slots       router ids -> slot ids (cache, staging, masked for the CPU lane); a step's Resolution
  lookahead   the next layer's router run ahead (predict_topk), its recall (RecallMeter) and live precision
  ahead_gate  AheadGate: per layer, whether the lookahead runs (nvme modes: only while the store works for it)
  lane_judge  whether offering decode steps to the CPU lane makes them faster, judged from their wall time
  timing      StepTimer: the one hook through which a step's host time is measured and charged

Nothing here imports exllamav3: the seam (glm53.exl3.tiered) hands the picks in and writes the slot
ids back, so the decisions run on the CPU in tests with CPU tensors standing in for VRAM.
"""
