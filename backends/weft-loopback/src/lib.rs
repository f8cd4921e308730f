//! The simulated loopback fabric: an adversarial, deterministic in-process weft backend
