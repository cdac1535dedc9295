"""The verbs that change a model in place, and the engines composed of them."""
