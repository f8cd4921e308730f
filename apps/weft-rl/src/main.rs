//! `weft-rl`: plan / simulate / run RL weight transfers.
fn main() {}
