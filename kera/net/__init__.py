"""Connections and the trust boundary: the server loop, client connections, CURVE, access rules, ACLs, quotas."""
