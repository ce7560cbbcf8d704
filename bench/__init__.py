"""kvmux benches: the long-session soak and the perf ratios (`kvmux bench ...`)."""
