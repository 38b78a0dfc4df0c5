"""Outside the ranks: start the rank processes of one run, watch them, recover them."""
