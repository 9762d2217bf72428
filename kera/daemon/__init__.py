"""What every daemon process shares: its environment, flags, identity, coordinator link, process policies, metrics."""
