"""Token trees: the shape of a tree draft (`TokenTree`) and how a batch of them is laid out for
one verification pass (`tree_metadata`, `kept_offsets`)."""
