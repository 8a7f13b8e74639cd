"""The decode loop: one loop, pluggable proposal policies (AR, chain, DDTree)."""
