"""A call traced to a jaxpr: its signature, static arguments, and the state it updates in its arguments."""
