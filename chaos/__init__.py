"""kvps_chaos: fault injection and checks for kvps clusters."""
