"""What `algorithm="auto"` resolves to: topology probes, the selector over the registry's cost
functions, the measured tuning pass, and the simulator harness that validates them."""
