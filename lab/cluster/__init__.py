"""The emulated cluster: hosts as network namespaces on one machine (`emulate_cluster`), compute paced to a
dedicated device's budget (`pacing`), and what ranks sharing a few cores cost the planner (`shared_cpu`,
`calibration_shared`)."""
