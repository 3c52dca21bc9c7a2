"""Tool calling: the tools a chat request offers (`tools`), how the model may call them
(`tool_choice`: "required" and a named function constrain the output), and the parsers that
read the calls out of a model's output (`parsers`); `request.tool_request` puts them together
for one request."""
