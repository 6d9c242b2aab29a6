"""Capacity planning in simulated time: the autoscaler on an arrival trace (`capacity_sim`), the
batching frontier of one replica (`frontier`, `frontier_sim`) and the fleet it implies per device
type (`capacity_plan`). Pure: no Redis, no torch; `launch.frontier_run` feeds them real runs."""
