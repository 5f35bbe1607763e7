"""Model output -> API fields: reasoning, tool calls (K3 XTML, the K2 family), tool_choice,
and request fields -> the output constraints they ask for (response_format)."""
