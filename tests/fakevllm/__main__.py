from tests.fakevllm.server import main

main()
