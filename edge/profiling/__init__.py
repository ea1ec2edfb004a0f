"""`edgectl profile`: what the box did over a window of work, as JSON and heat maps."""
