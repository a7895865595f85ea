"""Run the OpenHands SDK agent once against a legorl proxy. Copied into the sandbox and run
with the harness runtime's Python 3.12 venv, which has the SDK (legorl itself is not needed).

    python openhands_driver.py BASE_URL WORKSPACE PROMPT
"""

import os
import sys

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

from openhands.sdk import LLM, Agent, Conversation, Tool
from openhands.tools.file_editor import FileEditorTool
from openhands.tools.terminal import TerminalTool

base_url, workspace, prompt = sys.argv[1:4]
llm = LLM(model="openai/legorl-tiny", base_url=base_url, api_key="sk-legorl", usage_id="agent")
agent = Agent(llm=llm, tools=[Tool(name=TerminalTool.name), Tool(name=FileEditorTool.name)])
conversation = Conversation(agent=agent, workspace=workspace)
conversation.send_message(prompt)
conversation.run()
print("openhands-run: finished", flush=True)
