"""The emulated cluster: hosts as network namespaces on one machine (`emulate_cluster`), compute paced to a
dedicated device's budget (`pacing`), what ranks sharing a few cores cost the planner (`shared_cpu`: the planner's
extra cost term and its parameters beside the product's cluster file) and their calibration (`calibration_shared`,
run around the product's by `calibrate_emulated`)."""
