"""Real training data: a token file on disk (tokens), its windows as samples (dataset), a checkpointable loader
over them (loader), and the exactly-once ledger of the sample ids each committed step trained on (ledger)."""
