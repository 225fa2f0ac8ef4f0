"""KV tiers below the device: connectors that store full blocks and load them back."""
