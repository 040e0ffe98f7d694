"""The edge where a run starts: the flags every script shares, the launch and its config checked, sweeps' commands."""
