"""Building blocks shared by the decoder models: fused linears, RMSNorm, RoPE, weight loading."""
