"""What happens to a step's logits before anything is drawn: a request's logit_bias and
penalties (`processors`) and its candidate filters (`filters`), in both numerics."""
